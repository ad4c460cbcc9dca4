"""What agents and benchmark clients send, turned into prompts (pure: prepare, the templates,
the tool-call reader); the same through the real mesh is in test_openai_api.py."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import msgspec
import pytest

from schemas.events import (
    ChatMessage,
    FunctionCall,
    ImagePart,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    ToolCall,
    ToolFunction,
    ToolSpec,
)
from services.engines.tokenizer import HfTokenizer
from services.ingress.openai_api import ChatCompletionBody, ResponseShape
from services.ingress.prepare import ClientRequest, InvalidRequest, prepare
from services.ingress.tool_calls import ToolCallReader, parse_tool_calls
from services.mesh.config import MeshConfig
from tests.conftest import TEST_CONFIG

CONFIG = msgspec.toml.decode(TEST_CONFIG, type=MeshConfig)
ALL_FEATURES = frozenset({"logprobs", "tool_call", "json"})
WEATHER = ToolSpec(
    function=ToolFunction(
        name="get_weather",
        description="The weather in a city",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    )
)
SYSTEM = ChatMessage(role="system", content="You are a careful agent that checks the weather. " * 12)


def _prepare(messages: list[ChatMessage], features: frozenset[str] | None = ALL_FEATURES, **fields):  # type: ignore[no-untyped-def]
    request = ClientRequest(
        request_id="r1",
        tenant="acme",
        model="llama-3-8b",
        api="chat",
        prompt=None,
        messages=messages,
        max_tokens=64,
        **fields,
    )
    return prepare(request, CONFIG, time.time(), features)


def _refusal(messages: list[ChatMessage], **fields) -> InvalidRequest:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequest) as raised:
        _prepare(messages, **fields)
    return raised.value


def _agent_steps(steps: int) -> list[list[ChatMessage]]:
    """An agent conversation's message lists, step by step: each call's reply is a tool call,
    then the tool's result comes back."""
    history = [SYSTEM, ChatMessage(role="user", content=[TextPart(text="What is the weather in Oslo?")])]
    out = [list(history)]
    for step in range(1, steps):
        call = ToolCall(
            id=f"call_{step}",
            function=FunctionCall(name="get_weather", arguments=json.dumps({"city": "Oslo"})),
        )
        history += [
            ChatMessage(role="assistant", content=None, tool_calls=[call]),
            ChatMessage(role="tool", content=f"{10 + step} degrees", tool_call_id=call.id),
        ]
        out.append(list(history))
    return out


def test_an_agents_history_is_accepted_and_each_step_extends_the_last_token_for_token() -> None:
    prompts = [_prepare(messages, tools=[WEATHER]).prompt_tokens for messages in _agent_steps(5)]
    for before, after in itertools.pairwise(prompts):
        assert len(after) > len(before)
        assert after[: len(before)] == before


def test_content_parts_are_joined_as_text() -> None:
    parts = _prepare([ChatMessage(role="user", content=[TextPart(text="hello "), TextPart(text="world")])])
    text = _prepare([ChatMessage(role="user", content="hello world")])
    assert parts.prompt_tokens == text.prompt_tokens


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([ChatMessage(role="user", content=None)], "messages[0].content"),
        ([ChatMessage(role="tool", content="12 C")], "messages[0].tool_call_id"),
        ([ChatMessage(role="function", content="12 C")], "messages[0].name"),
        (
            [
                ChatMessage(
                    role="user", content=[TextPart(text="what is this"), ImagePart(image_url={"url": "x"})]
                )
            ],
            "messages[0].content[1]",
        ),
        (
            [
                ChatMessage(
                    role="user",
                    content="hi",
                    tool_calls=[ToolCall(id="c", function=FunctionCall(name="f", arguments="{}"))],
                )
            ],
            "messages[0].tool_calls",
        ),
    ],
    ids=["null-content", "tool-without-id", "function-without-name", "image-part", "user-tool-calls"],
)
def test_malformed_turns_are_refused_naming_the_field(messages: list[ChatMessage], param: str) -> None:
    assert _refusal(messages).param == param


def test_the_legacy_function_role_is_a_tool_result() -> None:
    call = ChatMessage(role="assistant", function_call=FunctionCall(name="get_weather", arguments="{}"))
    result = ChatMessage(role="function", name="get_weather", content="12 C")
    assert _prepare([SYSTEM, call, result]).prompt_tokens


def test_tool_choice_and_response_format_become_the_output_constraint() -> None:
    user = [ChatMessage(role="user", content="hi")]
    assert _prepare(user, tools=[WEATHER]).constraint is None  # auto: the model decides
    forced = _prepare(user, tools=[WEATHER], tool_choice="required").constraint
    assert forced is not None and forced.kind == "tool_call" and forced.tools == [WEATHER.function]
    named = NamedToolChoice(function=NamedFunction(name="get_weather"))
    assert _prepare(user, tools=[WEATHER], tool_choice=named).constraint == forced
    as_json = _prepare(user, response_format=ResponseFormat(type="json_object")).constraint
    assert as_json is not None and as_json.kind == "json"
    assert _refusal(user, tool_choice="required").param == "tool_choice"  # no tools
    other = NamedToolChoice(function=NamedFunction(name="get_time"))
    assert _refusal(user, tools=[WEATHER], tool_choice=other).param == "tool_choice"
    both = {
        "tools": [WEATHER],
        "tool_choice": "required",
        "response_format": ResponseFormat(type="json_object"),
    }
    assert _refusal(user, **both).param == "response_format"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": 2}, "logprobs"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ({"response_format": ResponseFormat(type="json_object")}, "response_format"),
    ],
    ids=["logprobs", "forced-tool-call", "json"],
)
def test_what_the_engines_cannot_honour_is_a_400_naming_it(fields: dict, param: str) -> None:  # type: ignore[type-arg]
    user = [ChatMessage(role="user", content="hi")]
    refusal = _refusal(user, features=frozenset(), **fields)
    assert (refusal.param, refusal.status, refusal.code) == (param, 400, "unsupported_parameter")
    assert _prepare(user, **fields) is not None  # honoured where the workers can


def test_the_tool_call_reader_holds_back_only_what_may_be_a_call() -> None:
    text = (
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    reader = ToolCallReader("call_")
    shown, calls = [], []
    for i in range(0, len(text), 3):  # as a stream brings it, a few characters at a time
        content, done = reader.feed(text[i : i + 3])
        shown.append(content)
        calls += done
    assert "".join(shown) + reader.finish() == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert parse_tool_calls(text, "call_") == ("Let me check.", calls)


def test_text_that_is_not_a_call_stays_text() -> None:
    for text in ["<tool_call>not json</tool_call> then", "a < b and <tool", "no call at all"]:
        assert parse_tool_calls(text, "c_") == (text, [])


def test_a_streamed_tool_call_arrives_as_one_delta_and_finishes_as_tool_calls() -> None:
    shape = ResponseShape("chat", "r1", "llama-3-8b", tool_calls=True)
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    chunks = [c for piece in text for c in shape.chunks(piece, None)] + shape.final_chunks("stop")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls == [
        [
            {
                "index": 0,
                "id": "call_r1_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ]
    ]
    assert deltas[0]["role"] == "assistant"
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_unset_sampling_parameters_pass_and_set_ones_are_named() -> None:
    base = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}]}
    neutral = {"top_p": 1.0, "presence_penalty": 0, "frequency_penalty": 0.0, "seed": 7, "user": "u"}
    assert msgspec.convert({**base, **neutral}, ChatCompletionBody).refused_parameter() is None
    for param, value in [
        ("top_p", 0.9),
        ("stop", ["\n"]),
        ("presence_penalty", 0.5),
        ("logit_bias", {"1": 5}),
    ]:
        assert msgspec.convert({**base, param: value}, ChatCompletionBody).refused_parameter() == param


# ---------------------------------------------------------------- a model's own chat template

TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _hf_tokenizer_dir(tmp_path: Path, template: str | None) -> Path:
    """A real Hugging Face tokenizer made here: byte-level BPE (no unknown tokens, merges that
    may cross a turn's boundary, as real ones do), trained on agent-like text, with a chat
    template."""
    tokenizers = pytest.importorskip("tokenizers", reason="the hf extra brings tokenizers")
    transformers = pytest.importorskip("transformers", reason="the hf extra brings transformers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    corpus = [
        role_tagged for messages in _agent_steps(4) for role_tagged in (str(messages), SYSTEM.content or "")
    ]
    bpe.train_from_iterator(corpus * 20, vocab_size=600, min_frequency=2, show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    if template is not None:
        tokenizer.chat_template = template
    folder = tmp_path / "model"
    tokenizer.save_pretrained(folder)
    return folder


def test_a_models_own_template_renders_the_agents_turns_and_extends_each_step(tmp_path: Path) -> None:
    tokenizer = HfTokenizer(str(_hf_tokenizer_dir(tmp_path, TEMPLATE)))
    rendered = [tokenizer.render_chat(messages, [WEATHER]) for messages in _agent_steps(4)]
    assert '"name": "get_weather"' in rendered[0]  # the tools, as the template shows them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in rendered[1]
    assert "<|im_start|>tool\n11 degrees<|im_end|>" in rendered[1]
    encoded = [tokenizer.encode(text) for text in rendered]
    for before, after in itertools.pairwise(encoded):
        assert after[: len(before)] == before


def test_a_template_without_tools_refuses_them_rather_than_dropping_them(tmp_path: Path) -> None:
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    tokenizer = HfTokenizer(str(_hf_tokenizer_dir(tmp_path, plain)))
    assert tokenizer.render_chat([ChatMessage(role="user", content="hi")]) == "user: hi\nassistant:"
    with pytest.raises(ValueError, match="does not render tools") as raised:
        tokenizer.render_chat([ChatMessage(role="user", content="hi")], [WEATHER])
    assert getattr(raised.value, "param", None) == "tools"


def test_the_class_a_request_gets_is_capped_by_its_tenants_config() -> None:
    from services.ingress.prepare import InvalidRequest, granted_priority
    from services.mesh.config import TenantConfig

    standard = TenantConfig(api_keys_sha256=[])
    assert granted_priority(None, standard) == "standard"  # none asked: the tenant's class
    assert granted_priority("sheddable", standard) == "sheddable"  # lower: as asked
    assert granted_priority("critical", standard) == "standard"  # above: downgraded
    anything = TenantConfig(api_keys_sha256=[], max_priority="critical")
    assert granted_priority("critical", anything) == "critical"
    strict = TenantConfig(api_keys_sha256=[], priority="sheddable", above_max_priority="reject")
    assert granted_priority(None, strict) == "sheddable"
    with pytest.raises(InvalidRequest) as refused:
        granted_priority("standard", strict)
    assert refused.value.status == 403 and refused.value.code == "priority_not_allowed"
