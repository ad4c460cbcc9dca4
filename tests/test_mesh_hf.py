"""The mesh with a real torch model: a prefill process hands real KV tensors to a decode process
through the JetStream Object Store, and the client gets exactly the tokens one process alone
would have generated (greedy)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the hf engine needs the hf extra (torch, transformers)")
pytest.importorskip("transformers", reason="the hf engine needs the hf extra (torch, transformers)")

from openai import BadRequestError

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from services.engines.factory import make_engine
from services.ingress.prepare import ClientRequest, prepare
from services.mesh.config import load_config
from services.mesh.embedded_nats import EmbeddedNats, free_port
from tests.conftest import openai_client, wait_for_workers

pytestmark = pytest.mark.timeout(240)

PROMPT = "the router picks a worker for the request and the cache " * 6
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def hf_mesh(test_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Its own NATS server: worker ids must not collide with the sim mesh's."""
    with EmbeddedNats(tmp_path_factory.mktemp("nats-hf")) as server:
        mesh = Mesh(
            data_dir=tmp_path_factory.mktemp("mesh-hf"),
            config_path=test_config,
            nats_url=server.url,
            http_port=free_port(),
            prefill=1,
            decode=1,
            engine="hf",
        )
        with mesh:
            yield mesh


async def _alone(test_config: Path, max_tokens: int) -> list[int]:
    """What one engine in this process generates for the same prompt."""
    config = load_config(test_config)
    request = prepare(
        ClientRequest(
            request_id="reference",
            tenant="acme",
            model="llama-3-8b",
            api="nats",
            prompt=PROMPT,
            messages=None,
            max_tokens=max_tokens,
        ),
        config,
        time.time(),
    )
    engine = make_engine({"engine": "hf"}, config)
    await engine.start()
    try:
        result = await engine.prefill(request)
        tokens = [result.first_token_id]
        async for step in engine.decode(request.request_id, result.first_token_id):
            tokens.extend(step.token_ids)
        return tokens
    finally:
        await engine.stop()


async def test_disaggregated_hf_serving_matches_one_process(hf_mesh: Mesh, test_config: Path) -> None:
    max_tokens = 24
    async with MeshClient(hf_mesh.url, "acme") as client:
        first = await client.complete(prompt=PROMPT, max_tokens=max_tokens)
        # The same prompt again: its prefix is now cached on the prefill worker.
        second = await client.complete(prompt=PROMPT, max_tokens=max_tokens)
    expected = await _alone(test_config, max_tokens)
    assert len(expected) == max_tokens
    assert first.token_ids == expected
    assert second.token_ids == expected
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens > 0


def test_a_real_model_answers_what_it_honours_and_refuses_the_rest_by_name(hf_mesh: Mesh) -> None:
    """The hf engine computes log-probabilities from its logits; it cannot constrain decoding, so
    a forced tool call or a JSON schema is a 400 naming the parameter, not ignored text."""
    wait_for_workers(hf_mesh)
    api = openai_client(hf_mesh)
    model = api.models.list().data[0]
    assert model.model_extra is not None and model.model_extra["features"] == ["logprobs"]

    reply = api.chat.completions.create(
        model="llama-3-8b",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=6,
        temperature=0,  # greedy: the sampled token is the likeliest
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # The alternatives come likeliest first, and greedy decoding took the likeliest.
        assert entry.top_logprobs[0].logprob == max(alt.logprob for alt in entry.top_logprobs)
        assert entry.logprob == entry.top_logprobs[0].logprob

    # Tools offered, choice left to the model: served (the model may or may not call one).
    auto = api.chat.completions.create(
        model="llama-3-8b", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=4
    )
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")

    for extra, param in (
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ):
        with pytest.raises(BadRequestError) as refused:
            api.chat.completions.create(
                model="llama-3-8b",
                messages=[{"role": "user", "content": "Weather?"}],
                max_tokens=4,
                **extra,  # type: ignore[arg-type]
            )
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == param, error
