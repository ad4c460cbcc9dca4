"""The vLLM engine's parts that need neither vLLM nor a GPU, run everywhere: reading vLLM's KV
event batches (msgpack, both encodings), translating its block hashes to the project's chain,
and the GPU-time and load bookkeeping from its scheduler stats. The engine itself is tested on a
GPU (test_vllm.py, test_contract.py's vllm parameter)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from services.engines.base import KvBlockEvent
from services.engines.vllm.accounting import SchedulerView, SequenceLoad, ShareClock, Throughput, batch_load
from services.engines.vllm.kv_events import (
    Cleared,
    KvEventTranslator,
    Removed,
    Stored,
    decode_batch,
)
from services.mesh.block_hash import chain_block_hashes

BS = 4
MODEL = "m"


def stored_array(hashes: list[int], parent: int | None, tokens: list[int], **extra: object) -> list[object]:
    # vLLM's array-like BlockStored: the tag, then block_hashes, parent_block_hash, token_ids,
    # block_size, lora_id, medium, lora_name, extra_keys, group_idx.
    return [
        "BlockStored",
        hashes,
        parent,
        tokens,
        extra.get("block_size", BS),
        extra.get("lora_id"),
        extra.get("medium", "GPU"),
        None,
        None,
        extra.get("group_idx", 0),
    ]


# ---------------------------------------------------------------- decoding batches


def test_a_batch_decodes_in_either_encoding_and_unknown_kinds_are_skipped() -> None:
    tokens = list(range(8))
    as_arrays = [
        1.5,
        [
            stored_array([11, 12], None, tokens),
            ["BlockRemoved", [11], "GPU", 0],
            ["SomethingNew", 1, 2],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    as_maps = {
        "ts": 1.5,
        "events": [
            {"type": "BlockStored", "block_hashes": [b"\x01", b"\x02"], "parent_block_hash": None,
             "token_ids": tokens, "block_size": BS},
            {"type": "BlockRemoved", "block_hashes": [b"\x01"], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
    }  # fmt: skip
    arrays = decode_batch(msgspec.msgpack.encode(as_arrays))
    assert arrays == [
        Stored((11, 12), None, tuple(tokens), BS, group_idx=0, medium="GPU"),
        Removed((11,), group_idx=0, medium="GPU"),
        Cleared(),
    ]
    maps = decode_batch(msgspec.msgpack.encode(as_maps))
    assert maps == [
        Stored((b"\x01", b"\x02"), None, tuple(tokens), BS),
        Removed((b"\x01",), medium="GPU"),
        Cleared(),
    ]


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode(7), msgspec.msgpack.encode([1.0, 5])])
def test_a_payload_that_is_not_a_batch_raises(payload: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, ValueError)):
        decode_batch(payload)


# ---------------------------------------------------------------- translating hashes


def prompt(n_blocks: int, start: int = 0) -> tuple[list[int], list[int]]:
    tokens = list(range(start, start + n_blocks * BS))
    return tokens, chain_block_hashes(tokens, BS, model=MODEL)


def test_stored_blocks_are_reported_by_the_project_hash_of_the_registered_prompt() -> None:
    tokens, ours = prompt(3)
    kv = KvEventTranslator(BS, MODEL)
    kv.register(tokens, ours)
    # vLLM's hashes are its own: the chain is followed through the parents it names.
    kv.feed([Stored((901, 902), None, tuple(tokens[: 2 * BS]), BS)])
    kv.feed([Stored((903,), 902, tuple(tokens[2 * BS :]), BS)])
    assert kv.drain() == [KvBlockEvent("stored", tuple(ours))]
    assert sorted(kv.cached()) == sorted(ours) and kv.cached_count == 3
    kv.feed([Removed((903, 902))])
    assert kv.drain() == [KvBlockEvent("removed", (ours[2], ours[1]))]
    assert kv.cached() == [ours[0]]
    kv.feed([Cleared()])
    assert kv.drain() == [KvBlockEvent("cleared")] and kv.cached_count == 0


def test_a_block_before_its_parent_waits_for_it_and_one_never_registered_is_never_reported() -> None:
    tokens, ours = prompt(2)
    kv = KvEventTranslator(BS, MODEL)
    kv.register(tokens, ours)
    kv.feed([Stored((902,), 901, tuple(tokens[BS:]), BS)])  # its parent not seen yet
    assert kv.drain() == [] and kv.cached_count == 0
    kv.feed([Stored((901,), None, tuple(tokens[:BS]), BS)])
    assert kv.drain() == [KvBlockEvent("stored", (ours[0], ours[1]))]
    # Tokens no request here registered (another client's prompt): the project cannot name the
    # block, so the router never hears of it.
    kv.feed([Stored((950,), None, (77, 78, 79, 80), BS)])
    assert kv.drain() == [] and kv.cached_count == 2


def test_two_vllm_blocks_of_one_content_are_one_project_block_until_both_are_evicted() -> None:
    # vLLM keys a block by more than its tokens (a cache salt, extra keys): one content, two
    # vLLM blocks, one project block, removed only when neither is cached.
    tokens, ours = prompt(1)
    kv = KvEventTranslator(BS, MODEL)
    kv.register(tokens, ours)
    kv.feed([Stored((901,), None, tuple(tokens), BS), Stored((801,), None, tuple(tokens), BS)])
    assert kv.drain() == [KvBlockEvent("stored", (ours[0],))]
    kv.feed([Removed((901,))])
    assert kv.drain() == [] and kv.cached() == [ours[0]]
    kv.feed([Removed((801,))])
    assert kv.drain() == [KvBlockEvent("removed", (ours[0],))]


@pytest.mark.parametrize(
    "event",
    [
        {"group_idx": 1},  # a sliding-window or Mamba group of a hybrid model
        {"medium": "CPU"},  # offloaded, not on the GPU
        {"lora_id": 3},  # an adapter's blocks: not the base model's prefix
        {"block_size": BS * 2},  # another block size: the tokens would not line up
    ],
)
def test_blocks_the_router_cannot_use_are_not_reported(event: dict[str, object]) -> None:
    tokens, ours = prompt(2)
    kv = KvEventTranslator(BS, MODEL)
    kv.register(tokens, ours)
    (raw,) = decode_batch(msgspec.msgpack.encode([0.0, [stored_array([901, 902], None, tokens, **event)]]))
    kv.feed([raw])
    assert kv.drain() == [] and kv.cached_count == 0


def test_a_prompts_cached_prefix_is_its_leading_blocks_the_cache_holds() -> None:
    tokens, ours = prompt(3)
    kv = KvEventTranslator(BS, MODEL)
    kv.register(tokens, ours)
    assert kv.cached_prefix_blocks(ours) == 0
    kv.feed([Stored((901, 902), None, tuple(tokens[: 2 * BS]), BS)])
    assert kv.cached_prefix_blocks(ours) == 2
    kv.feed([Removed((901,))])  # the first block gone: nothing of the prefix is usable
    assert kv.cached_prefix_blocks(ours) == 0 and kv.cached_count == 1


def test_a_lost_batch_resets_what_is_believed_cached() -> None:
    tokens, ours = prompt(2)
    kv = KvEventTranslator(BS, MODEL)
    kv.register(tokens, ours)
    kv.feed([Stored((901, 902), None, tuple(tokens), BS)])
    kv.reset()
    assert kv.drain() == [KvBlockEvent("stored", tuple(ours)), KvBlockEvent("cleared")]
    assert kv.cached_count == 0


# ---------------------------------------------------------------- GPU time and load


def test_processor_sharing_charges_each_running_request_its_share_and_idle_time_to_none() -> None:
    clock = ShareClock(0.0)
    # A runs over [0, 2], B over [1, 2]; then nothing runs over [2, 3].
    clock.step(1.0, 1)
    clock.step(2.0, 2)
    clock.step(3.0, 0)
    a, b = clock.charge(0.0, 2.0), clock.charge(1.0, 2.0)
    assert (a, b) == pytest.approx((1.5, 0.5))
    assert a + b == pytest.approx(2.0)  # the GPU's busy time, split between them
    assert clock.charge(2.0, 3.0) == 0.0
    assert clock.charge(1.5, 1.0) == 0.0 and clock.charge(None, 1.0) == 0.0
    # Inside an interval the share is read at that interval's occupancy.
    assert clock.charge(1.0, 1.5) == pytest.approx(0.25)


def test_the_scheduler_view_reads_vllms_stats_whatever_the_release() -> None:
    view = SchedulerView(ShareClock(0.0))
    view.record(1.0, SimpleNamespace(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25))
    assert (view.seen, view.running, view.waiting, view.kv_usage) == (True, 3, 2, 0.25)
    # An older release names the usage gpu_cache_usage; preemptions come with the step's stats.
    view.record(2.0, SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, gpu_cache_usage=0.5))
    view.record(2.5, None, SimpleNamespace(num_preempted_reqs=2))
    view.record(3.0, None, SimpleNamespace(num_preempted_reqs=1))
    assert (view.running, view.kv_usage, view.preemptions) == (1, 0.5, 3)
    # Each report closes the interval its step ran: 3 requests over [0, 1], then 1 over [1, 2].
    assert view.share.charge(0.0, 1.0) == pytest.approx(1 / 3)
    assert view.share.charge(1.0, 2.0) == pytest.approx(1.0)


def test_throughput_is_tokens_over_the_window() -> None:
    rate = Throughput(window_s=5.0)
    rate.add(0.0, 100)
    rate.add(1.0, 150)
    assert rate.rate(2.0) == pytest.approx(50.0)
    assert rate.rate(5.5) == pytest.approx(30.0)  # the first fell out of the window
    assert rate.rate(20.0) == 0.0


def test_the_batch_load_counts_prompts_to_prefill_and_the_decoding_context() -> None:
    sequences = [
        SequenceLoad(1000, 0, first_token_out=False, needs_prefill=True, cached_prompt_tokens=640),
        SequenceLoad(64, 0, first_token_out=False, needs_prefill=True, cached_prompt_tokens=64),
        SequenceLoad(500, 0, first_token_out=False, needs_prefill=False),  # its KV was pulled
        SequenceLoad(300, 20, first_token_out=True, needs_prefill=True),
        SequenceLoad(200, 5, first_token_out=True, needs_prefill=False),
    ]
    # To prefill: 360 uncached tokens, and the one token a fully cached prompt still computes.
    # Decoding: the prompts and tokens of the two whose first token is out.
    assert batch_load(sequences, queue_depth=2, running=2) == (361, 525)
    # The scheduler's counts may be a step ahead: each waiting or running request counts at
    # least one token.
    assert batch_load([], queue_depth=3, running=4) == (3, 4)


def test_each_adapter_has_one_lora_id_whatever_the_config_order() -> None:
    from services.engines.vllm.engine import lora_ids

    ids = lora_ids({"b-lora": "/b", "a-lora": "/a", "c-lora": "/c"})
    # vLLM reads 0 as "no adapter"; the same ids on every worker and after every restart.
    assert ids == {"a-lora": 1, "b-lora": 2, "c-lora": 3}
    assert lora_ids({"c-lora": "/c", "a-lora": "/a", "b-lora": "/b"}) == ids
