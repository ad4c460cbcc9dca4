"""The published event contract stays compatible with the released one (schemas/compat.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import msgspec
import pytest

from schemas import compat, generate
from schemas.events import Event

# ---------------------------------------------------------------- the real contract


def _released() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(compat.RELEASED_PATH.read_text(encoding="utf-8"))
    return doc


def test_current_contract_is_compatible_with_the_released_one() -> None:
    released = _released()
    assert compat.incompatibilities(released, generate.asyncapi()) == []
    committed = json.loads(compat.CURRENT_PATH.read_text(encoding="utf-8"))
    assert compat.incompatibilities(released, committed) == []


def test_released_contract_is_compatible_with_itself() -> None:
    assert compat.incompatibilities(_released(), _released()) == []


def test_removed_event() -> None:
    current = copy.deepcopy(_released())
    del current["components"]["messages"]["RequestCancelled"]
    assert compat.incompatibilities(_released(), current) == ["event request.cancelled.v1 removed"]


def test_new_tag_is_the_old_event_removed() -> None:
    current = copy.deepcopy(_released())
    current["components"]["messages"]["DecodeCompleted"]["x-ripplemesh-tag"] = "request.decode_completed.v2"
    assert compat.incompatibilities(_released(), current) == [
        "event request.decode_completed.v1 removed (DecodeCompleted is now request.decode_completed.v2)"
    ]


def test_subject_changed_but_not_a_parameter_renamed() -> None:
    current = copy.deepcopy(_released())
    messages = current["components"]["messages"]
    messages["DecodeCompleted"]["x-ripplemesh-subject"] = "rmesh.events.decoded"
    messages["DecodeWork"]["x-ripplemesh-subject"] = "rmesh.work.decode.{worker_id}"
    assert compat.incompatibilities(_released(), current) == [
        "event request.decode_completed.v1: subject rmesh.events.decode_completed -> rmesh.events.decoded"
    ]


def test_narrowed_enum_in_the_real_contract() -> None:
    current = copy.deepcopy(_released())
    current["components"]["schemas"]["WorkerState"]["properties"]["role"] = {"enum": ["decode"]}
    assert compat.incompatibilities(_released(), current) == ['WorkerState.role: enum lost value "prefill"']


def test_nested_struct_change_is_reported_once_under_its_name() -> None:
    current = copy.deepcopy(_released())
    current["components"]["schemas"]["Usage"]["properties"]["prompt_tokens"] = {"type": "string"}
    assert compat.incompatibilities(_released(), current) == ["Usage.prompt_tokens: type integer -> string"]


# ---------------------------------------------------------------- each kind of change


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int


_BASE: dict[str, tuple[Any, ...]] = {
    "latency_s": (float,),
    "message": (str,),
    "finish_reason": (Literal["length", "stop"],),
    "usage": (Usage,),
    "note": (str | None, None),
    "max_tokens": (int, 256),
}


def _event(**changes: tuple[Any, ...] | None) -> type[Event]:
    """A `DecodeCompleted` with `changes` to its fields (None removes one)."""
    spec = {**_BASE, **changes}
    fields = [(name, *f) for name, f in spec.items() if f is not None]
    cls = msgspec.defstruct(
        "DecodeCompleted",
        fields,
        bases=(Event,),
        tag="request.decode_completed.v1",
        frozen=True,
        kw_only=True,
    )
    return cast(type[Event], cls)


def _doc(*classes: type[Event]) -> dict[str, Any]:
    """An AsyncAPI document of `classes`, their schemas made the way schemas/generate.py does."""
    _, schemas = msgspec.json.schema_components(classes, ref_template="#/components/schemas/{name}")
    messages = {
        cls.__name__: {
            "payload": {"$ref": f"#/components/schemas/{cls.__name__}"},
            "x-ripplemesh-tag": generate.event_tag(cls),
            "x-ripplemesh-subject": "rmesh.events.decode_completed",
        }
        for cls in classes
    }
    return {"asyncapi": "3.0.0", "components": {"schemas": schemas, "messages": messages}}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param({"message": None}, ["DecodeCompleted: field message removed"], id="remove-field"),
        pytest.param(
            {"message": None, "text": (str,)},
            ["DecodeCompleted: field message removed", "DecodeCompleted.text: new required field"],
            id="rename-field",
        ),
        pytest.param(
            {"latency_s": (str,)}, ["DecodeCompleted.latency_s: type number -> string"], id="retype"
        ),
        pytest.param(
            {"latency_s": (float | None, None)},
            ["DecodeCompleted.latency_s: type number -> number | null"],
            id="make-nullable",
        ),
        pytest.param(
            {"max_tokens": (int,)},
            ["DecodeCompleted.max_tokens: optional field made required"],
            id="optional-made-required",
        ),
        pytest.param({"foo": (int,)}, ["DecodeCompleted.foo: new required field"], id="add-required"),
        pytest.param({"foo": (int, 0)}, [], id="add-optional"),
        pytest.param({"latency_s": (float, 0.0)}, [], id="required-made-optional"),
        pytest.param(
            {"finish_reason": (Literal["stop"],)},
            ['DecodeCompleted.finish_reason: enum lost value "length"'],
            id="narrow-enum",
        ),
        pytest.param({"finish_reason": (Literal["length", "stop", "tool_calls"],)}, [], id="widen-enum"),
        pytest.param(
            {"usage": (msgspec.defstruct("Usage", [("prompt_tokens", str)], frozen=True, kw_only=True),)},
            ["Usage.prompt_tokens: type integer -> string"],
            id="retype-nested",
        ),
        pytest.param(
            {"max_tokens": (Annotated[int, msgspec.Meta(ge=1)], 256)},
            ["DecodeCompleted.max_tokens: new minimum 1"],
            id="tighten-bound",
        ),
    ],
)
def test_kind_of_change(changes: dict[str, tuple[Any, ...] | None], expected: list[str]) -> None:
    assert compat.incompatibilities(_doc(_event()), _doc(_event(**changes))) == expected


# ---------------------------------------------------------------- the command


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    released, current = tmp_path / "released.json", tmp_path / "current.json"
    released.write_text(json.dumps(_doc(_event())), encoding="utf-8")
    current.write_text(json.dumps(_doc(_event(foo=(int, 0)))), encoding="utf-8")
    assert compat.main(["--released", str(released), "--current", str(current)]) == 0
    assert capsys.readouterr().out == "compatible with the released contract (1 events)\n"

    current.write_text(json.dumps(_doc(_event(message=None))), encoding="utf-8")
    assert compat.main(["--released", str(released), "--current", str(current)]) == 1
    out = capsys.readouterr()
    assert out.out == "DecodeCompleted: field message removed\n"
    assert "incompatible" in out.err

    assert compat.main(["--released", str(tmp_path / "missing.json"), "--current", str(current)]) == 2
