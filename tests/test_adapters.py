"""LoRA adapters end to end: named in the OpenAI `model` field (``<model>:<adapter>`` or the
adapter alone), registered in the mesh config, carried on the request, seeding its block hashes,
loaded by the sim engine on first use and announced in its heartbeat."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest

from ripplemesh.client import MeshClient, MeshError
from ripplemesh.launcher import Mesh
from schemas.events import InferenceRequest, PrefillCompleted, WorkerState
from schemas.subjects import WORKERS, event_subject
from services.engines.base import EngineError, VirtualClock
from services.engines.sim.engine import SimEngine
from services.ingress.prepare import ClientRequest, InvalidRequest, prepare
from services.mesh.block_hash import chain_block_hashes
from services.mesh.bus import Bus, kv_keys
from services.mesh.config import MeshConfig
from tests.conftest import TEST_CONFIG, TEST_KEY, async_wait_until, wait_for_workers

pytestmark = pytest.mark.timeout(180)

MODEL = "llama-3-8b"
BLOCK = 16
ADAPTERS = """adapters = [
  {name = "sql-lora", load_s = 2.0},
  {name = "chat-lora", path = "/adapters/chat-lora"},
]
"""
ADAPTER_CONFIG = TEST_CONFIG.replace(
    "max_context_tokens = 4096\n", "max_context_tokens = 4096\n" + ADAPTERS, 1
)


def config_of(text: str) -> MeshConfig:
    return msgspec.toml.decode(text, type=MeshConfig)


def client_request(model: str, prompt: str = "the same prompt " * 8) -> ClientRequest:
    return ClientRequest(
        request_id="r1", tenant="acme", model=model, api="chat", prompt=prompt, messages=None, max_tokens=4
    )


# ------------------------------------------------------------------ config and ingress


def test_the_config_registers_adapters_under_their_model_and_resolves_each_way_to_name_one() -> None:
    config = config_of(ADAPTER_CONFIG)
    model = config.model(MODEL)
    assert model is not None and [a.name for a in model.adapters] == ["sql-lora", "chat-lora"]
    sql = model.adapter("sql-lora")
    assert sql is not None and sql.load_s == 2.0 and sql.path is None
    assert config.model_and_adapter(MODEL) == (model, None)
    assert config.model_and_adapter(f"{MODEL}:sql-lora") == (model, sql)
    assert config.model_and_adapter("sql-lora") == (model, sql)  # by its own name
    assert config.model_and_adapter(f"{MODEL}:no-such-lora") is None
    assert config.model_and_adapter("other-model:sql-lora") is None
    assert config.base_model_name("sql-lora") == MODEL
    assert config.base_model_name("unknown") == "unknown"


@pytest.mark.parametrize(
    ("adapters", "error"),
    [
        ('[{name = "a"}, {name = "a"}]', "adapters named twice"),
        ('[{name = "llama-3-8b"}]', "adapters named as models"),
        ('[{name = "bad:name"}]', "adapters\\[0\\].name"),
        ('[{name = "a", load_s = -1.0}]', "load_s"),
        ('[{name = "a", unknown = 1}]', "unknown"),
    ],
)
def test_the_config_refuses_adapters_that_do_not_name_one_thing(adapters: str, error: str) -> None:
    text = TEST_CONFIG.replace(
        "max_context_tokens = 4096\n", f"max_context_tokens = 4096\nadapters = {adapters}\n"
    )
    with pytest.raises(msgspec.ValidationError, match=error):
        config_of(text)


def test_prepare_fills_the_adapter_and_seeds_the_block_hashes_with_it() -> None:
    config = config_of(ADAPTER_CONFIG)
    plain = prepare(client_request(MODEL), config, now=0.0)
    named = prepare(client_request(f"{MODEL}:sql-lora"), config, now=0.0)
    alone = prepare(client_request("sql-lora"), config, now=0.0)
    assert plain.adapter is None and named.adapter == alone.adapter == "sql-lora"
    assert named.model == alone.model == MODEL
    assert plain.block_hashes == chain_block_hashes(plain.prompt_tokens, BLOCK, model=MODEL)
    assert named.block_hashes == alone.block_hashes != plain.block_hashes


def test_an_unknown_adapter_or_model_is_a_404_naming_it() -> None:
    config = config_of(ADAPTER_CONFIG)
    with pytest.raises(InvalidRequest) as unknown_adapter:
        prepare(client_request(f"{MODEL}:no-such-lora"), config, now=0.0)
    assert unknown_adapter.value.status == 404 and unknown_adapter.value.code == "model_not_found"
    assert "'no-such-lora'" in unknown_adapter.value.message and "sql-lora" in unknown_adapter.value.message
    with pytest.raises(InvalidRequest) as unknown_model:
        prepare(client_request("no-such-model"), config, now=0.0)
    assert unknown_model.value.status == 404 and "'no-such-model'" in unknown_model.value.message


def test_the_same_prompt_under_two_adapters_shares_no_block_hash() -> None:
    tokens = list(range(100, 164))
    base = chain_block_hashes(tokens, BLOCK, model=MODEL)
    sql = chain_block_hashes(tokens, BLOCK, model=MODEL, adapter="sql-lora")
    chat = chain_block_hashes(tokens, BLOCK, model=MODEL, adapter="chat-lora")
    assert len(base) == len(sql) == len(chat) == 4
    assert not set(sql) & set(chat) and not set(sql) & set(base) and not set(chat) & set(base)
    # No adapter: the model's hashes, as before adapters existed.
    assert chain_block_hashes(tokens, BLOCK, model=MODEL, adapter=None) == base
    assert chain_block_hashes(tokens, BLOCK, model=MODEL, adapter="sql-lora") == sql  # stable


# ------------------------------------------------------------------ the sim engine


def sim_request(rid: str, adapter: str | None, prompt: list[int]) -> InferenceRequest:
    return InferenceRequest(
        request_id=rid,
        tenant="acme",
        model=MODEL,
        adapter=adapter,
        api="nats",
        prompt_tokens=prompt,
        block_size=BLOCK,
        block_hashes=chain_block_hashes(prompt, BLOCK, model=MODEL, adapter=adapter),
        max_tokens=4,
        submitted_at=0.0,
    )


async def test_the_sim_engine_loads_an_adapter_once_on_first_use_and_announces_it() -> None:
    clock = VirtualClock()
    engine = SimEngine(
        model=MODEL, block_size=BLOCK, clock=clock, adapters={"sql-lora": 2.0, "chat-lora": 1.0}
    )
    assert engine.info.adapters == ("sql-lora", "chat-lora") and engine.info.adapter_load_s == 2.0
    await engine.start()
    try:
        prompt = list(range(300, 364))
        assert engine.snapshot().adapters == ()
        started = clock.now()
        # Two requests for the adapter at once: one load, both wait for it.
        first, second = await asyncio.gather(
            engine.prefill(sim_request("a", "sql-lora", prompt)),
            engine.prefill(sim_request("b", "sql-lora", [*prompt[:32], *range(500, 532)])),
        )
        assert clock.now() - started >= 2.0
        assert engine.snapshot().adapters == ("sql-lora",)
        engine.release("a")
        engine.release("b")
        started = clock.now()
        again = await engine.prefill(sim_request("c", "sql-lora", prompt))
        assert clock.now() - started < 1.0  # loaded: no second load
        assert again.cached_tokens > 0
        # The same prompt under the other adapter: loads it, and reuses nothing.
        other = await engine.prefill(sim_request("d", "chat-lora", prompt))
        assert other.cached_tokens == 0
        assert engine.snapshot().adapters == ("sql-lora", "chat-lora")
        assert first.first_token_id != other.first_token_id or first.kv.block_hashes != other.kv.block_hashes
        assert second.cached_tokens >= 0
    finally:
        await engine.stop()


async def test_engines_refuse_an_adapter_they_do_not_serve() -> None:
    engine = SimEngine(model=MODEL, block_size=BLOCK, clock=VirtualClock(), adapters={"sql-lora": 1.0})
    await engine.start()
    try:
        with pytest.raises(EngineError, match=r"adapter .other-lora. is not served.*its adapters: sql-lora"):
            await engine.prefill(sim_request("x", "other-lora", list(range(300, 332))))
    finally:
        await engine.stop()
    plain = SimEngine(model=MODEL, block_size=BLOCK, clock=VirtualClock())
    with pytest.raises(EngineError, match="its adapters: none"):
        await plain.prefill(sim_request("y", "sql-lora", list(range(300, 332))))


# ------------------------------------------------------------------ through the mesh


@pytest.fixture(scope="module")
def adapter_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The mesh of conftest's `mesh`, its model serving two adapters, on its own NATS server (so
    its workers are the only ones the test sees)."""
    from services.mesh.embedded_nats import free_port

    config_path = tmp_path_factory.mktemp("adapter-config") / "ripplemesh.toml"
    config_path.write_text(ADAPTER_CONFIG)
    running = Mesh(
        data_dir=tmp_path_factory.mktemp("adapter-mesh"),
        config_path=Path(config_path),
        http_port=free_port(),
        prefill=1,
        decode=1,
        time_scale=0.05,
    ).start()
    wait_for_workers(running)
    yield running
    running.stop()


@pytest.fixture
async def adapter_bus(adapter_mesh: Mesh) -> AsyncIterator[Bus]:
    assert adapter_mesh.auth is not None
    connected = await Bus.connect(adapter_mesh.url, "tests", credentials=adapter_mesh.auth.service)
    yield connected
    await connected.close()


async def worker_states(bus: Bus) -> list[WorkerState]:
    kv = await bus.key_value(WORKERS)
    states = []
    for key in await kv_keys(bus.js, WORKERS.bucket):
        entry = await kv.get(key)
        if entry.value:
            states.append(msgspec.json.decode(entry.value, type=WorkerState))
    return states


def test_models_lists_each_model_and_its_adapters(adapter_mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{adapter_mesh.http_port}/v1", api_key=TEST_KEY)
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL, f"{MODEL}:sql-lora", f"{MODEL}:chat-lora"]
    body = httpx.get(
        f"http://127.0.0.1:{adapter_mesh.http_port}/v1/models",
        headers={"authorization": f"Bearer {TEST_KEY}"},
    ).json()
    assert body["data"][0]["adapters"] == ["sql-lora", "chat-lora"]
    assert body["data"][1]["parent"] == MODEL


def test_an_unknown_adapter_is_a_404_naming_it_over_http(adapter_mesh: Mesh) -> None:
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{adapter_mesh.http_port}/v1", api_key=TEST_KEY, max_retries=0
    )
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(
            model=f"{MODEL}:no-such-lora", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    error: Any = missing.value.body
    assert error["code"] == "model_not_found" and "no-such-lora" in error["message"]


async def test_an_unknown_adapter_is_a_404_naming_it_over_nats(adapter_mesh: Mesh) -> None:
    async with MeshClient(adapter_mesh.url, "acme", credentials=adapter_mesh.credentials("acme")) as client:
        with pytest.raises(MeshError) as rejected:
            await client.complete(prompt="hi", max_tokens=4, model=f"{MODEL}:no-such-lora")
        assert rejected.value.http_status == 404 and "no-such-lora" in rejected.value.message
        done = await client.complete(prompt="over nats " * 8, max_tokens=4, model="chat-lora")
        assert done.usage.completion_tokens == 4


async def test_a_chat_completion_under_an_adapter_loads_it_and_reuses_kv_only_under_it(
    adapter_mesh: Mesh, adapter_bus: Bus
) -> None:
    bus = adapter_bus
    prefills: dict[str, PrefillCompleted] = {}

    async def on_prefill(msg: Any) -> None:
        event = msgspec.json.decode(msg.data, type=PrefillCompleted)
        prefills[event.request_id] = event

    subscription = await bus.nc.subscribe(event_subject("prefill_completed"), cb=on_prefill)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{adapter_mesh.http_port}/v1", api_key=TEST_KEY, max_retries=0
    )
    messages: Any = [{"role": "user", "content": "Explain the query plan of a join, step by step. " * 8}]

    async def ask(model: str) -> PrefillCompleted:
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=4)
        assert reply.model == model and reply.choices[0].message.content
        request_id = reply.id.removeprefix("chatcmpl-")
        return await async_wait_until(lambda: prefills.get(request_id))  # type: ignore[no-any-return]

    try:
        first = await ask(f"{MODEL}:sql-lora")
        assert first.cached_tokens == 0

        async def loaded_on_a_worker() -> bool:
            return any("sql-lora" in w.adapters for w in await worker_states(bus))

        for _ in range(60):  # heartbeats every second or so
            if await loaded_on_a_worker():
                break
            await asyncio.sleep(0.25)
        assert await loaded_on_a_worker(), "no heartbeat announces sql-lora loaded"
        assert all(w.adapter_load_s == 2.0 for w in await worker_states(bus) if w.model == MODEL)

        same = await ask(f"{MODEL}:sql-lora")
        assert same.cached_tokens > 0, same
        other = await ask(f"{MODEL}:chat-lora")
        assert other.cached_tokens == 0, other
        plain = await ask(MODEL)
        assert plain.cached_tokens == 0, plain
    finally:
        await subscription.unsubscribe()
        await client.close()
