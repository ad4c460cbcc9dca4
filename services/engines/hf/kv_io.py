"""A prefilled prompt's KV as bytes, for the hand-off from a prefill worker to a decode worker.

The bytes are a safetensors file (no pickle: a decode worker loads nothing executable from the
wire) holding one tensor, "kv" [layers, 2, kv_heads, tokens, head_dim], and string metadata that
says what it is: format, model name and fingerprint, token count, block size, a digest of the
prompt's tokens, dtype and shape. `load` checks all of it against what the importer expects
before it reads the tensor, and raises EngineError("invalid") with the first mismatch.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from services.engines.base import EngineError

FORMAT = "ripplemesh.hf-kv.v1"
_MAX_HEADER_BYTES = 1 << 20


def prompt_digest(tokens: list[int]) -> str:
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class KvMeta:
    model: str
    fingerprint: str
    block_size: int
    tokens: list[int]
    layers: int
    kv_heads: int
    head_dim: int


def dump(kv: torch.Tensor, meta: KvMeta) -> bytes:
    metadata = {
        "format": FORMAT,
        "model": meta.model,
        "fingerprint": meta.fingerprint,
        "num_tokens": str(len(meta.tokens)),
        "block_size": str(meta.block_size),
        "prompt_digest": prompt_digest(meta.tokens),
        "dtype": str(kv.dtype).removeprefix("torch."),
        "shape": json.dumps(list(kv.shape)),
    }
    return bytes(st_save({"kv": kv.detach().contiguous().cpu()}, metadata=metadata))


def _header(payload: bytes) -> dict[str, str]:
    if len(payload) < 8:
        raise EngineError(f"KV payload is {len(payload)} bytes: not a KV file")
    size = int.from_bytes(payload[:8], "little")
    if size > min(_MAX_HEADER_BYTES, len(payload) - 8):
        raise EngineError("KV payload is corrupt (bad header size)")
    try:
        header = json.loads(payload[8 : 8 + size])
    except ValueError as exc:
        raise EngineError(f"KV payload is corrupt (unreadable header: {exc})") from exc
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise EngineError("KV payload has no metadata: not a ripplemesh KV file")
    return metadata


def load(payload: bytes, expect: KvMeta, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The KV tensor in `payload`, on `device` in `dtype`, after checking it is what `expect` says."""
    meta = _header(payload)
    if meta.get("format") != FORMAT:
        raise EngineError(f"KV payload format is {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("model") != expect.model:
        raise EngineError(
            f"KV was computed by model {meta.get('model')!r}, this engine serves {expect.model!r}"
        )
    if meta.get("fingerprint") != expect.fingerprint:
        raise EngineError(
            f"KV was computed by a different build of {expect.model!r} "
            f"(fingerprint {meta.get('fingerprint')}, here {expect.fingerprint})"
        )
    if meta.get("block_size") != str(expect.block_size):
        raise EngineError(f"KV block size is {meta.get('block_size')}, this engine uses {expect.block_size}")
    if meta.get("num_tokens") != str(len(expect.tokens)):
        raise EngineError(f"KV covers {meta.get('num_tokens')} tokens, the prompt has {len(expect.tokens)}")
    if meta.get("prompt_digest") != prompt_digest(expect.tokens):
        raise EngineError("KV was computed for a different prompt (token digest mismatch)")
    shape = [expect.layers, 2, expect.kv_heads, len(expect.tokens), expect.head_dim]
    if meta.get("shape") != json.dumps(shape):
        raise EngineError(f"KV shape is {meta.get('shape')}, this model needs {shape}")
    try:
        tensors = st_load(payload)
    except Exception as exc:
        raise EngineError(f"KV payload is corrupt: {exc}") from exc
    kv = tensors.get("kv")
    if kv is None or list(kv.shape) != shape:
        raise EngineError(
            f"KV tensor is missing or its shape {None if kv is None else list(kv.shape)} is wrong"
        )
    if not kv.is_floating_point():
        raise EngineError(f"KV tensor has dtype {kv.dtype}, not a float type")
    kv = kv.to(device=device, dtype=dtype)
    if not torch.isfinite(kv).all():
        raise EngineError("KV tensor holds non-finite values")
    return kv
