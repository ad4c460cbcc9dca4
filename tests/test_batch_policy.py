"""The batch runner's release policy and the Batch API's line formats, pure: no bus, no clock."""

from __future__ import annotations

import msgspec
import pytest

from services.batch.policy import BatchLimits, RunnerState, WorkerLoad, expired, interactive_load, release
from services.batch.records import MalformedLine, failure_line, parse_line, split_lines, success_line

LIMITS = BatchLimits(slots_per_worker=8, target_occupancy=0.75, max_in_flight=64, max_release=16)
IDLE = WorkerLoad(running=0, queue_depth=0, kv_used=0.1)
NOW = 1_000.0


def test_an_idle_fleet_takes_its_spare_slots() -> None:
    decision = release([IDLE, IDLE], RunnerState(pending=100, in_flight=0), LIMITS, NOW)
    assert decision.reason == "released"
    assert decision.count == 12  # 2 workers x floor(8 x 0.75)
    assert decision.spare_slots == 12


def test_lines_in_flight_are_counted_once() -> None:
    # The heartbeats count the batch's running lines too: they are not interactive load.
    busy_with_batch = WorkerLoad(running=4, queue_depth=0, kv_used=0.3)
    decision = release([busy_with_batch, IDLE], RunnerState(pending=100, in_flight=4), LIMITS, NOW)
    assert decision.interactive_load == 0
    assert decision.count == 12 - 4


def test_interactive_load_leaves_the_batch_only_what_is_spare() -> None:
    loaded = WorkerLoad(running=5, queue_depth=0, kv_used=0.5)
    decision = release([loaded, IDLE], RunnerState(pending=100, in_flight=0), LIMITS, NOW)
    assert decision.interactive_load == 5
    assert decision.count == 12 - 5
    full = WorkerLoad(running=6, queue_depth=0, kv_used=0.5)
    assert (
        release([full, full], RunnerState(pending=100, in_flight=0), LIMITS, NOW).reason
        == "no_spare_capacity"
    )


def test_never_more_than_pending_nor_the_caps() -> None:
    assert release([IDLE] * 4, RunnerState(pending=3, in_flight=0), LIMITS, NOW).count == 3
    assert (
        release([IDLE] * 10, RunnerState(pending=1000, in_flight=0), LIMITS, NOW).count == LIMITS.max_release
    )
    capped = release([IDLE] * 20, RunnerState(pending=1000, in_flight=60), LIMITS, NOW)
    assert capped.count == LIMITS.max_in_flight - 60


def test_interactive_pressure_pauses_it_for_the_hold() -> None:
    state = RunnerState(pending=100, in_flight=0, last_pressure_at=NOW - 1.0)
    assert release([IDLE, IDLE], state, LIMITS, NOW).reason == "interactive_pressure"
    assert release([IDLE, IDLE], state, LIMITS, NOW + LIMITS.pressure_hold_s).reason == "released"


def test_its_own_pushback_backs_off() -> None:
    state = RunnerState(pending=100, in_flight=0, last_pushback_at=NOW - 0.5)
    assert release([IDLE], state, LIMITS, NOW).reason == "pushback"
    assert release([IDLE], state, LIMITS, NOW + LIMITS.pushback_s).count > 0


def test_a_queueing_fleet_gets_nothing_more() -> None:
    queueing = WorkerLoad(running=2, queue_depth=3, kv_used=0.5)
    assert (
        release([queueing, IDLE], RunnerState(pending=10, in_flight=0), LIMITS, NOW).reason
        == "fleet_queueing"
    )
    # Its own lines waiting at a worker are no interactive queue.
    own_queue = WorkerLoad(running=0, queue_depth=2, kv_used=0.1)
    assert release([own_queue, IDLE], RunnerState(pending=10, in_flight=2), LIMITS, NOW).count > 0


def test_a_full_kv_cache_offers_no_slot_and_draining_workers_none() -> None:
    full_kv = WorkerLoad(running=0, queue_depth=0, kv_used=0.9)
    assert release([full_kv, IDLE], RunnerState(pending=100, in_flight=0), LIMITS, NOW).count == 6
    draining = WorkerLoad(running=0, queue_depth=0, kv_used=0.0, draining=True)
    assert release([draining], RunnerState(pending=100, in_flight=0), LIMITS, NOW).reason == "no_workers"
    assert release([], RunnerState(pending=100, in_flight=0), LIMITS, NOW).reason == "no_workers"


def test_nothing_pending_releases_nothing() -> None:
    assert release([IDLE], RunnerState(pending=0, in_flight=3), LIMITS, NOW).reason == "nothing_pending"


def test_interactive_load_and_expiry() -> None:
    assert interactive_load([WorkerLoad(3, 1, 0.0), WorkerLoad(2, 0, 0.0)], 4) == 2
    assert interactive_load([WorkerLoad(1, 0, 0.0)], 4) == 0
    assert not expired(NOW + 1, NOW)
    assert expired(NOW, NOW)


# ---------------------------------------------------------------- lines


def _line(body: dict[str, object], url: str = "/v1/chat/completions", custom_id: str = "a") -> bytes:
    return msgspec.json.encode({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_chat_line_and_a_completion_line() -> None:
    chat = parse_line(
        1,
        _line({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
        "/v1/chat/completions",
    )
    assert (chat.api, chat.model, chat.max_tokens, chat.custom_id, chat.line) == ("chat", "m", 5, "a", 1)
    completion = parse_line(2, _line({"model": "m", "prompt": ["x"]}, "/v1/completions"), "/v1/completions")
    assert (completion.api, completion.prompt, completion.max_tokens) == ("completion", "x", 16)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{not json", "line 7: not valid JSON"),
        (b'{"custom_id": "a"}', "line 7: Object missing required field `method`"),
        (_line({"model": "m", "prompt": "x"}, "/v1/completions"), "is not the batch's endpoint"),
        (_line({"model": "m"}), "line 7: invalid body"),
        (
            _line({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}),
            "cannot stream",
        ),
        (_line({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}), "n = 1"),
        (_line({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0.5}), "top_p"),
    ],
)
def test_a_malformed_line_names_its_line(raw: bytes, says: str) -> None:
    with pytest.raises(MalformedLine) as caught:
        parse_line(7, raw, "/v1/chat/completions")
    assert says in caught.value.message
    assert caught.value.message.startswith("line 7")


def test_lines_keep_their_numbers_in_the_file() -> None:
    assert split_lines(b'{"a":1}\n\n  \n{"b":2}\n') == [(1, b'{"a":1}'), (4, b'{"b":2}')]


def test_output_and_error_lines_have_openai_s_shape() -> None:
    ok = success_line("batch_abc", 3, "c3", "req-1", {"object": "chat.completion"})
    assert ok == {
        "id": "batch_req_abc_3",
        "custom_id": "c3",
        "response": {"status_code": 200, "request_id": "req-1", "body": {"object": "chat.completion"}},
        "error": None,
    }
    refused = failure_line(
        "batch_abc", 4, "c4", code="model_not_found", message="line 4: no", status_code=404
    )
    assert refused["response"]["status_code"] == 404
    assert refused["response"]["body"]["error"]["code"] == "model_not_found"
    assert refused["error"] == {"code": "model_not_found", "message": "line 4: no", "line": 4}
    malformed = failure_line("batch_abc", 5, None, code="invalid_line", message="line 5: bad")
    assert malformed["response"] is None and malformed["error"]["line"] == 5


def test_the_mesh_config_sets_the_batch_limits_and_refuses_bad_ones() -> None:
    from services.mesh.config import MeshConfig
    from tests.conftest import TEST_CONFIG

    config = msgspec.toml.decode(
        TEST_CONFIG + "\n[batch]\nmax_in_flight = 4\npressure_hold_s = 1.5\n", type=MeshConfig
    )
    limits = config.batch.limits()
    assert (limits.max_in_flight, limits.pressure_hold_s) == (4, 1.5)
    assert limits.slots_per_worker == BatchLimits().slots_per_worker  # the rest: the policy's defaults
    # A fleet of idle workers releases no more than the config lets it.
    assert release([IDLE] * 8, RunnerState(pending=100, in_flight=3), limits, NOW).count == 1
    with pytest.raises(msgspec.ValidationError, match="target_occupancy"):
        msgspec.toml.decode(TEST_CONFIG + "\n[batch]\ntarget_occupancy = 2.0\n", type=MeshConfig)
    with pytest.raises(msgspec.ValidationError, match="slots"):
        msgspec.toml.decode(TEST_CONFIG + "\n[batch]\nslots = 4\n", type=MeshConfig)
