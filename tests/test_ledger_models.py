"""The ledger per model on a real SQLite file and a real PostgreSQL: the model a prefill or a
decode reports is kept on its request, and each model's spend reported apart."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

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
