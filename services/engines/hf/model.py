"""Loading a causal LM and running its forward passes on explicit KV.

Everything here runs on the engine's compute thread (never on the event loop). KV layouts:

- a sequence's KV, outside the decode batch: one tensor [layers, 2, kv_heads, tokens, head_dim]
  (2: keys, values), the same layout as a prefix-cache block and as the exported bytes;
- the decode batch: a transformers `DynamicCache` of left-padded [batch, kv_heads, width, head_dim]
  tensors per layer, with a padding mask (see `DecodeBatch`).

Works with transformers 4.44+ and 5.x: the cache keyword (`past_key_values` became `cache`) and the
logits-trimming keyword are found from the model's signature, masks are passed as explicit 4D
additive masks where padding is involved, and positions are always explicit.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from schemas.events import TokenAlternative, TokenLogprob
from services.engines.base import EngineError
from services.engines.tokenizer import SimpleTokenizer, tokenizer_for

TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # Larger than the usual 0.02, so a random model's logits have clear winners (stable argmax).
    "initializer_range": 0.2,
}


class Tokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _config_fingerprint(config: Any, extra: str = "") -> str:
    data = config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation"):
        data.pop(volatile, None)
    text = json.dumps(data, sort_keys=True, default=str) + extra
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class KvShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


class LoadedModel:
    """A causal LM, its tokenizer, and the few forward passes the engine needs."""

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        *,
        device: torch.device,
        max_context_tokens: int,
        eos_token_ids: set[int],
        fingerprint: str,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = device
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.vocab_size: int = int(model.get_input_embeddings().weight.shape[0])
        self.eos_token_ids = eos_token_ids
        self.fingerprint = fingerprint
        config_context = getattr(model.config, "max_position_embeddings", None) or max_context_tokens
        self.max_context_tokens = min(max_context_tokens, int(config_context))
        # LoRA adapters it may serve (name -> local PEFT directory), loaded on first use.
        self.adapter_paths: dict[str, str] = {}
        self.loaded_adapters: list[str] = []  # in load order
        self.adapter_load_s: dict[str, float] = {}
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        # One token through the model: warms it up and tells the KV shape of every layer.
        _, cache = self.prefill([0], None)
        self.kv_shape = KvShape(cache.shape[0], cache.shape[2], cache.shape[4], cache.dtype)

    # ------------------------------------------------------------ loading

    @classmethod
    def tiny_llama(
        cls,
        *,
        seed: int = 0,
        device: torch.device,
        max_context_tokens: int = 4096,
        overrides: dict[str, Any] | None = None,
    ) -> LoadedModel:
        """A randomly initialised small Llama, the same weights for the same seed on every machine.

        Its vocabulary is the project's SimpleTokenizer plus one EOS id, so that tokenizer serves.
        """
        tokenizer = SimpleTokenizer()
        settings = {**TINY_DEFAULTS, **(overrides or {})}
        eos = tokenizer.vocab_size
        config = LlamaConfig(
            vocab_size=tokenizer.vocab_size + 1,
            max_position_embeddings=max_context_tokens,
            bos_token_id=None,
            eos_token_id=eos,
            pad_token_id=None,
            tie_word_embeddings=False,
            **settings,
        )
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        with torch.no_grad():
            # A random model would otherwise end about one reply in twenty-five at random: with EOS's
            # logit pinned at 0 (others spread wide), replies run to max_tokens, like the sim
            # engine's. EOS handling is exercised by giving the engine other `eos_token_ids`.
            model.get_output_embeddings().weight[eos].zero_()
        model = model.to(device=device, dtype=torch.float32)
        return cls(
            model,
            tokenizer,
            device=device,
            max_context_tokens=max_context_tokens,
            eos_token_ids={eos},
            fingerprint=_config_fingerprint(config, f"/tiny-llama/seed={seed}"),
        )

    @classmethod
    def from_path(
        cls,
        path: str,
        *,
        device: torch.device,
        max_context_tokens: int = 8192,
        dtype: torch.dtype | None = None,
    ) -> LoadedModel:
        """A local Hugging Face model directory (or an already-downloaded hub id); never downloads."""
        if dtype is None:
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        dtype_kw = "dtype" if _transformers_major() >= 5 else "torch_dtype"
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, attn_implementation="sdpa", **{dtype_kw: dtype}
            )
        except Exception as exc:
            raise EngineError(f"cannot load model {path!r}: {exc}") from exc
        model = model.to(device)
        vocab = int(model.get_input_embeddings().weight.shape[0])
        # The same choice as the ingress makes when it tokenizes prompts for this model.
        try:
            tokenizer = tokenizer_for(path)
        except Exception as exc:
            raise EngineError(f"model {path!r} has an unusable tokenizer: {exc}") from exc
        if isinstance(tokenizer, SimpleTokenizer) and vocab < tokenizer.vocab_size:
            raise EngineError(
                f"model {path!r} has no tokenizer files and its vocabulary ({vocab}) is smaller than "
                f"the word tokenizer's ({tokenizer.vocab_size})"
            )
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(model.config, "eos_token_id", None)
        eos_ids = (
            {int(e) for e in eos}
            if isinstance(eos, list | tuple)
            else ({int(eos)} if eos is not None else set())
        )
        return cls(
            model,
            tokenizer,
            device=device,
            max_context_tokens=max_context_tokens,
            eos_token_ids=eos_ids,
            # The architecture, not the directory: workers may keep the same model in other places.
            fingerprint=_config_fingerprint(model.config),
        )

    # ------------------------------------------------------------ forward passes

    def _load_adapter(self, name: str) -> None:
        """Load a LoRA adapter beside the others (PEFT): the model becomes a PeftModel at the
        first, and each row of a forward pass then names its adapter (or the base model)."""
        from peft import PeftModel

        path = self.adapter_paths.get(name)
        if path is None:
            raise EngineError(f"adapter {name!r} has no path to load it from")
        started = time.perf_counter()
        try:
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(path, adapter_name=name)
            else:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
        except (OSError, ValueError) as exc:
            raise EngineError(f"adapter {name!r} could not be loaded from {path}: {exc}") from exc
        self.model.eval()
        self.adapter_load_s[name] = time.perf_counter() - started
        self.loaded_adapters.append(name)

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        mask: Any,
        adapters: list[str | None] | None = None,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True, "position_ids": position_ids}
        if mask is not None:
            kwargs["attention_mask"] = mask
        rows = adapters or [None] * int(input_ids.shape[0])
        for name in {a for a in rows if a is not None} - set(self.loaded_adapters):
            self._load_adapter(name)
        if self.loaded_adapters:
            # Once one is loaded every pass says each row's adapter: a row without one is the
            # base model's (PEFT's "__base__"), not the adapter loaded last.
            kwargs["adapter_names"] = [a if a is not None else "__base__" for a in rows]
        if self._logits_kw is not None:
            kwargs[self._logits_kw] = 1
        out = self.model(input_ids=input_ids, **kwargs)
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def prefill(
        self, tokens: list[int], prefix: torch.Tensor | None, adapter: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute the prompt's KV after the cached `prefix` (its first tokens' KV, or None),
        under the LoRA `adapter` (None: the base model).

        Returns the next-token logits [vocab] and the whole prompt's KV [layers, 2, kvh, n, hd].
        """
        done = 0 if prefix is None else prefix.shape[3]
        cache = DynamicCache()
        if prefix is not None:
            for layer in range(prefix.shape[0]):
                cache.update(prefix[layer, 0].unsqueeze(0), prefix[layer, 1].unsqueeze(0), layer)
        ids = torch.tensor([tokens[done:]], dtype=torch.long, device=self.device)
        positions = torch.arange(done, len(tokens), device=self.device).unsqueeze(0)
        logits = self._forward(ids, positions, cache, None, [adapter])
        kv = torch.stack([torch.stack((k[0], v[0])) for k, v in cache_tensors(cache)])
        return logits[0], kv


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) of a DynamicCache, across transformers versions."""
    layers = getattr(cache, "layers", None)
    if layers is not None and layers and hasattr(layers[0], "keys"):
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


class BatchMember(Protocol):
    """What the decode batch needs of a sequence (the engine's `_Sequence`)."""

    kv: torch.Tensor | None  # the KV outside the batch; None while the batch holds it
    retired: bool  # finished or released: its KV need not be kept
    length: int  # tokens whose KV is computed
    last_token: int  # the token to feed next (its KV is not computed yet)

    @property
    def adapter(self) -> str | None: ...  # its LoRA adapter (None: the base model)


class DecodeBatch:
    """The sequences decoding together: one forward pass advances all of them by one token.

    The batch keeps one left-padded KV cache: row i holds sequence i's KV in the last `length_i`
    columns of `width`; a boolean mask marks the padding, turned into a 4D additive attention
    mask each step, and every row gets its own position id, so a padded row computes exactly what
    it would alone (up to float rounding). Every step appends one column for all rows.

    The cache is rebuilt only when the membership changes (a sequence joins or leaves): members
    staying are cut out of the old cache, and all are stacked again, padded to the longest, so
    padding never outlives the sequence that needed it.
    """

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.members: list[BatchMember] = []
        self._cache: Any = None
        self._valid: torch.Tensor | None = None  # [batch, width] bool
        self.rebuilds = 0

    @property
    def width(self) -> int:
        return 0 if self._valid is None else int(self._valid.shape[1])

    def clear(self) -> None:
        self.members, self._cache, self._valid = [], None, None

    def _take_out(self, keep: list[BatchMember]) -> None:
        """Members' KV back into their own tensors (all but the retired, unless in `keep`)."""
        if self._cache is None:
            return
        keeping = {id(m) for m in keep}
        tensors = cache_tensors(self._cache)
        width = self.width
        for row, member in enumerate(self.members):
            # `retired` is set by the event loop meanwhile; a member of the next step is always kept.
            if member.kv is None and (id(member) in keeping or not member.retired):
                start = width - member.length
                member.kv = torch.stack(
                    [torch.stack((k[row, :, start:], v[row, :, start:])) for k, v in tensors]
                )
        self.clear()

    def _build(self, members: list[BatchMember]) -> None:
        width = max(m.length for m in members)
        first = members[0].kv
        assert first is not None
        layers, _, kv_heads, _, head_dim = first.shape
        buf = first.new_zeros((layers, 2, len(members), kv_heads, width, head_dim))
        valid = torch.zeros((len(members), width), dtype=torch.bool, device=first.device)
        for row, member in enumerate(members):
            assert member.kv is not None
            buf[:, :, row, :, width - member.length :] = member.kv
            valid[row, width - member.length :] = True
            member.kv = None
        cache = DynamicCache()
        for layer in range(layers):
            cache.update(buf[layer, 0], buf[layer, 1], layer)
        self.members, self._cache, self._valid = list(members), cache, valid
        self.rebuilds += 1

    @torch.inference_mode()
    def step(self, members: list[BatchMember]) -> torch.Tensor:
        """One forward pass for `members` (in this order); returns next-token logits [batch, vocab]."""
        if [id(m) for m in members] != [id(m) for m in self.members]:
            self._take_out(members)
            self._build(members)
        assert self._valid is not None
        device = self.lm.device
        ids = torch.tensor([[m.last_token] for m in members], dtype=torch.long, device=device)
        positions = torch.tensor([[m.length] for m in members], dtype=torch.long, device=device)
        valid = torch.cat(
            [self._valid, torch.ones((len(members), 1), dtype=torch.bool, device=device)], dim=1
        )
        mask = torch.zeros((len(members), 1, 1, valid.shape[1]), dtype=self.lm.dtype, device=device)
        mask.masked_fill_(~valid[:, None, None, :], torch.finfo(self.lm.dtype).min)
        logits = self.lm._forward(ids, positions, self._cache, mask, [m.adapter for m in members])
        self._valid = valid
        for m in members:
            m.length += 1
        return logits


def sample(logits: torch.Tensor, temperature: float, seed: int) -> int:
    """Greedy at temperature 0; else a draw from softmax(logits / T) with a generator seeded per token."""
    if temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    generator = torch.Generator().manual_seed(seed)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], ks: list[int], tokenizer: Tokenizer
) -> list[TokenLogprob]:
    """Row i's sampled token `tokens[i]` with its log-probability and the `ks[i]` likeliest
    alternatives (descending), from the raw logits [rows, vocab]: log_softmax before any
    temperature, as vLLM reports by default. One log_softmax and one top-k for all rows."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(tokens, dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    k = min(max(ks, default=0), logp.shape[-1])
    top_values: list[list[float]] = [[] for _ in tokens]
    top_ids: list[list[int]] = [[] for _ in tokens]
    if k > 0:
        values, indices = torch.topk(logp, k, dim=-1, sorted=True)
        top_values, top_ids = values.tolist(), indices.tolist()
    out = []
    for row, token in enumerate(tokens):
        n = ks[row]
        top = [
            TokenAlternative(token_id=int(i), token=tokenizer.decode([int(i)]), logprob=float(v))
            for i, v in zip(top_ids[row][:n], top_values[row][:n], strict=True)
        ]
        out.append(
            TokenLogprob(token_id=token, token=tokenizer.decode([token]), logprob=float(chosen[row]), top=top)
        )
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device) -> float:
    """A timestamp after the device finished its queued work (so spans measure compute)."""
    synchronize(device)
    return time.perf_counter()
