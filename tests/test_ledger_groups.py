"""The ledger's requests grouped on a real SQLite file and a real PostgreSQL: by service class
(interactive, Batch API lines) and by model; what a report says is kept on its request, and
each group reported apart, whatever the order its events come in."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from schemas.events import RequestFailed, RequestRejected
from services.ledger.fold import fold
from services.ledger.store import LedgerStore
from tests.test_ledger_store import PRICES, decode, fresh_database, prefill


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[LedgerStore]:
    async with fresh_database(request.param, tmp_path / "ledger.db") as kwargs:
        ledger = await LedgerStore.open(**kwargs)
        try:
            yield ledger
        finally:
            await ledger.close()


def test_the_fold_keeps_a_batch_decodes_class() -> None:
    batch = msgspec.structs.replace(decode("e-d", "b1", "acme", "h100", 2.0), service_class="batch")
    folded = fold([prefill("e-p", "b1", "acme", "h100", 1.0), batch], PRICES)
    (delta,) = folded.requests
    assert delta.service_class == "batch"
    (plain,) = fold([decode("e-i", "i1", "acme", "h100", 2.0)], PRICES).requests
    assert plain.service_class is None


async def test_classes_are_reported_apart(store: LedgerStore) -> None:
    # A batch line's prefill comes after its decode here: the class still lands on its row.
    events = [
        msgspec.structs.replace(decode("e-b1-d", "b1", "acme", "h100", 2.0), service_class="batch"),
        prefill("e-b1-p", "b1", "acme", "h100", 1.0),
        prefill("e-b2-p", "b2", "acme", "h100", 1.0),
        msgspec.structs.replace(decode("e-b2-d", "b2", "acme", "h100", 1.0), service_class="batch"),
        decode("e-i1-d", "i1", "acme", "h100", 4.0),
        prefill("e-i2-p", "i2", "acme", "h100", 1.0),  # still running
    ]
    for event in events:
        assert await store.record(event, PRICES)
    classes = {c["service_class"]: c for c in await store.by_class()}
    assert list(classes) == ["interactive", "batch"]
    batch, interactive = classes["batch"], classes["interactive"]
    assert (batch["requests"], batch["completed"]) == (2, 2)
    assert batch["gpu_seconds"] == pytest.approx(5.0)
    assert batch["spend_usd"] == pytest.approx(5.0 * PRICES["h100"] / 3600)
    assert batch["cost_per_completed_request_usd"] == pytest.approx(batch["spend_usd"] / 2)
    assert (interactive["requests"], interactive["completed"], interactive["running"]) == (2, 1, 1)
    assert interactive["cost_per_completed_request_usd"] == pytest.approx(interactive["spend_usd"])
    assert (await store.request("b1") or {})["service_class"] == "batch"
    assert (await store.request("i1") or {})["service_class"] is None


async def test_a_batch_line_refused_or_failed_is_counted_in_its_class(store: LedgerStore) -> None:
    """RequestRejected and RequestFailed carry the class too: a Batch API line the mesh refuses
    (a 404 model, a 400) or a worker fails is reported as batch, not interactive."""
    rejected = RequestRejected(
        event_id="e-b3-r",
        occurred_at=10.0,
        request_id="b3",
        tenant="acme",
        stage="ingress",
        reason="invalid",
        message="unknown model",
        service_class="batch",
    )
    failed = RequestFailed(
        event_id="e-b4-f",
        occurred_at=11.0,
        request_id="b4",
        tenant="acme",
        stage="decode",
        worker_id="w1",
        message="engine error",
        service_class="batch",
    )
    plain = RequestRejected(
        event_id="e-i3-r",
        occurred_at=12.0,
        request_id="i3",
        tenant="acme",
        stage="admission",
        reason="quota",
        message="over quota",
    )
    for event in (prefill("e-b4-p", "b4", "acme", "h100", 1.0), rejected, failed, plain):
        assert await store.record(event, PRICES)
    classes = {c["service_class"]: c for c in await store.by_class()}
    batch, interactive = classes["batch"], classes["interactive"]
    assert (batch["requests"], batch["rejected"], batch["failed"]) == (2, 1, 1)
    assert batch["gpu_seconds"] == pytest.approx(1.0)  # the failed line's prefill
    assert (interactive["requests"], interactive["rejected"]) == (1, 1)
    assert (await store.request("b3") or {})["service_class"] == "batch"
    assert (await store.request("b4") or {})["service_class"] == "batch"
    assert (await store.request("i3") or {})["service_class"] is None


async def test_each_models_spend_is_reported_apart(store: LedgerStore) -> None:
    def on(event: Any, model: str | None) -> Any:
        return msgspec.structs.replace(event, model=model)

    events = [
        on(prefill("e-a1-p", "a1", "acme", "h100", 1.0), "llama-3-8b"),
        on(decode("e-a1-d", "a1", "acme", "h100", 2.0), "llama-3-8b"),
        # The decode's report comes first here; the prefill's model fills nothing it lacks.
        on(decode("e-q1-d", "q1", "acme", "h100", 4.0), "qwen-7b"),
        on(prefill("e-q1-p", "q1", "acme", "h100", 1.0), "qwen-7b"),
        on(prefill("e-q2-p", "q2", "acme", "h100", 3.0), "qwen-7b"),  # still running
        decode("e-o1-d", "o1", "acme", "h100", 1.0),  # an older producer: no model said
    ]
    for event in events:
        assert await store.record(event, PRICES)
    models = {m["model"]: m for m in await store.by_model()}
    assert sorted(models) == ["llama-3-8b", "qwen-7b", "unknown"]
    llama, qwen = models["llama-3-8b"], models["qwen-7b"]
    assert (llama["requests"], llama["completed"]) == (1, 1)
    assert llama["gpu_seconds"] == pytest.approx(3.0)
    assert (qwen["requests"], qwen["completed"], qwen["running"]) == (2, 1, 1)
    assert qwen["spend_usd"] == pytest.approx(8.0 * PRICES["h100"] / 3600)
    assert qwen["cost_per_completed_request_usd"] == pytest.approx(qwen["spend_usd"])
    assert models["unknown"]["requests"] == 1
    assert (await store.request("q1") or {})["model"] == "qwen-7b"
