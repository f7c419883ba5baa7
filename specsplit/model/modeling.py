"""Load a local HF causal LM and run it with a per-sequence KV cache that rolls back by position.

Where the model and machine allow it (specsplit.model.fastllama: Llama-family, AVX-512 CPU), sequences
run on the native kernels, which are exact by construction; otherwise on transformers' forward,
made exact as follows. Exact mode (the default) makes a token's logits independent of how many
tokens share its forward, so verifying k drafted tokens in one call gives bit-identical logits to
decoding them one by one.
What it takes was measured on this project's CPUs (docs/architecture.md, "Exactness"):
- attention: torch's SDPA gives a query row a result that depends on the number of query rows and
  on masked keys after it. Eager attention is row-invariant in bf16; fp32 needs each query row to
  attend exactly as a 1-token decode would (rowwise_attention).
- linears: CPU GEMM kernels change with the number of rows (RowInvariantLinear).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.model.identity import tokenizer_fingerprint, weights_fingerprint
from specsplit.speculation import rollback
from specsplit.speculation.rollback import Rollback

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


class FlatLinear(nn.Linear):
    """nn.Linear applied to a 2-D [rows, in] view of its input.

    A one-row input sliced out of a longer sequence (transformers' `logits_to_keep`) keeps the
    long tensor's leading strides, and CPU GEMM then takes a slow path: 81 ms instead of 2.3 ms for
    the 49152 x 576 bf16 output head (measured). Reshaping to 2-D gives it ordinary strides.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [rows, in]
        return self._linear(flat).reshape(*x.shape[:-1], -1)

    def _linear(self, flat: torch.Tensor) -> torch.Tensor:
        return F.linear(flat, self.weight, self.bias)


class RowInvariantLinear(FlatLinear):
    """A linear whose result for a row does not depend on the other rows in the call.

    bf16 (measured): every row count >= 2 takes the same kernel, one row a different one, so a lone
    row is padded with a zero row. fp32 (measured): MKL's sgemm result changes with the row count,
    so rows are multiplied in independent pairs (a batched [pairs, 2, in] @ [in, out]).
    """

    def _linear(self, flat: torch.Tensor) -> torch.Tensor:
        rows, width = flat.shape
        if self.weight.dtype == torch.float32:
            return self._paired(flat)
        if rows == 1:
            return F.linear(torch.cat([flat, flat.new_zeros(1, width)]), self.weight, self.bias)[:1]
        return F.linear(flat, self.weight, self.bias)

    def _paired(self, flat: torch.Tensor) -> torch.Tensor:
        rows, width = flat.shape
        if rows % 2:
            flat = torch.cat([flat, flat.new_zeros(1, width)])
        pairs = flat.shape[0] // 2
        weight_t = self.weight.t().unsqueeze(0).expand(pairs, width, self.out_features)  # [pairs, in, out]
        out = torch.bmm(flat.view(pairs, 2, width), weight_t).reshape(-1, self.out_features)[:rows]
        return out if self.bias is None else out + self.bias


ROWWISE_ATTENTION = "specsplit_rowwise"
# Prefill (many rows) is shared by speculation on and off, so it need not be row-invariant.
_ROWWISE_MAX_ROWS = 32


def rowwise_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Causal attention for one unpadded sequence (the only kind the services run). Up to
    _ROWWISE_MAX_ROWS query rows, row r attends to the first past+r+1 keys with the same
    [1 x d] @ [d x n] products a 1-token decode runs, so its output does not depend on the other
    rows in the call. The mask is built here: transformers prepares none for custom attention."""
    from transformers.models.llama.modeling_llama import repeat_kv

    q_len = query.shape[2]  # query: [batch, heads, q_len, head_dim]
    keys = repeat_kv(key, module.num_key_value_groups)  # [batch, heads, kv_len, head_dim]
    values = repeat_kv(value, module.num_key_value_groups)
    past = keys.shape[2] - q_len
    if q_len > _ROWWISE_MAX_ROWS:
        scores = torch.matmul(query, keys.transpose(2, 3)) * scaling  # [batch, heads, q_len, kv_len]
        future = torch.ones(q_len, keys.shape[2], dtype=torch.bool, device=query.device).triu(past + 1)
        probs = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(probs, values).transpose(1, 2).contiguous(), None
    rows = []
    for r in range(q_len):
        visible = past + r + 1
        scores = torch.matmul(query[:, :, r:r + 1], keys[:, :, :visible].transpose(2, 3)) * scaling
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # [batch, heads, 1, visible]
        rows.append(torch.matmul(probs, values[:, :, :visible]))
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None  # [batch, q_len, heads, head_dim]


def _register_rowwise_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)


def attention_for(dtype: torch.dtype, exact: bool) -> str:
    if not exact:
        return "sdpa"
    # Rowwise attention costs ~+50 % on a 9-row verify; bf16 is exact with plain eager (measured).
    return ROWWISE_ATTENTION if dtype == torch.float32 else "eager"


def swap_linears(model: nn.Module, cls: type[FlatLinear]) -> None:
    """Turn every nn.Linear into `cls` in place (same parameters)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = cls


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    model_id: str
    fingerprint: str
    max_context: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    exact: bool
    param_bytes: int
    model_fingerprint: str
    hidden_size: int
    native: object = None  # the FastLlama its sequences run on; None: transformers' forward
    kernels: str = "transformers"  # what runs the forward, for logs and Info

    def release_transformers_weights(self) -> int:
        """Frees transformers' copy of every weight the native kernels packed for themselves (all
        but the input embedding, which they share), so a verify service holds the weights once;
        returns the bytes freed. Afterwards only KVSequence (native) runs the model."""
        if self.native is None:
            return 0
        keep = {id(self.model.get_input_embeddings().weight)}
        freed = 0
        for module in self.model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) in keep or not param.numel() or param.is_meta:
                    continue
                freed += param.numel() * param.element_size()
                setattr(module, name, nn.Parameter(param.new_empty(0), requires_grad=False))
        _return_free_memory()
        return freed

    def set_kv_budget(self, budget_bytes: int) -> str:
        """Bounds the KV cache of all sequences together; returns a line saying what it holds."""
        if self.native is None:
            return "KV cache: transformers' dynamic cache, not bounded by a budget"
        self.native.pool.budget_bytes = budget_bytes
        per_token = self.native.token_bytes
        tokens = budget_bytes // per_token
        return (f"KV cache budget {budget_bytes / 2**20:.0f} MiB = {tokens} tokens at {per_token} B/token "
                f"({tokens // self.max_context} sessions at the full context of {self.max_context})")

    @property
    def eos_token_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        ids = ids if ids is not None else self.tokenizer.eos_token_id
        if ids is None:
            return []
        return sorted(set(ids if isinstance(ids, list) else [ids]))


# from_pretrained swaps process-wide torch defaults (meta device init) while it runs: two loads on
# different threads of one process corrupt each other. Services load one model each; tests run
# several services in one process.
_LOAD_LOCK = threading.Lock()


def load_model(path: str | Path, dtype: str = "bfloat16", device: str = "cpu", exact: bool = True,
               native: bool = True, quantize: str = "", head_ids: torch.Tensor | None = None) -> LoadedModel:
    """Load a local HF causal-LM directory (config, weights, tokenizer). Never touches a model hub.
    Sequences run on the native kernels when `native` and the model and machine allow it; `exact`
    chooses how transformers' forward runs otherwise. quantize "int8": weight-only int8 GEMMs on the
    native kernels (refused where they do not run). head_ids: the native head computes only these
    vocabulary rows (a drafter's draft vocabulary)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a HF model directory (no config.json)")
    torch_dtype = parse_dtype(dtype)
    _register_rowwise_attention()
    attention = attention_for(torch_dtype, exact)
    with _LOAD_LOCK:
        if quantize == "gguf" and native and torch.device(device).type == "cpu":  # the file has the GEMM weights
            from specsplit.model.ggufweights import gguf_path

            gguf_path(path)  # refused with the reason before anything is read
            model = _without_gemm_weights(path, torch_dtype, attention)  # on the CPU, as the kernels
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, attn_implementation=attention, local_files_only=True)
            model.to(device)
        model.eval()
    model.requires_grad_(False)
    swap_linears(model, RowInvariantLinear if exact else FlatLinear)
    native, kernels = _native(model, quantize, head_ids, path) if native else (None, "transformers (native off)")
    if quantize and native is None:
        raise ValueError(f"--quantize {quantize} needs the native kernels; {kernels}")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = model.config
    max_context = int(getattr(config, "max_position_embeddings", 0) or 2048)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=path.name,
        fingerprint=tokenizer_fingerprint(tokenizer),
        max_context=max_context,
        vocab_size=int(config.vocab_size),
        dtype=torch_dtype,
        device=torch.device(device),
        exact=exact,
        param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        model_fingerprint=weights_fingerprint(path),
        hidden_size=int(config.hidden_size),
        native=native,
        kernels=kernels,
    )


def _gemm_weight(key: str) -> bool:
    """A checkpoint key the native kernels pack (a decoder projection's or the head's weight)."""
    return key == "lm_head.weight" or (".layers." in key and key.endswith("_proj.weight"))


def _without_gemm_weights(path: Path, dtype: torch.dtype, attention: str) -> nn.Module:
    """The model of `path` with every tensor of its checkpoint but the GEMM weights, which stay on
    the meta device (no memory): for --quantize gguf, whose kernels pack them from model.gguf. The
    1.5B target otherwise read 3 GB of bf16 weights only to free them, and glibc kept most of it
    (RSS after loading and releasing 3.49 GB, against 1.85 GB this way)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            state.update({k: f.get_tensor(k).to(dtype) for k in f.keys() if not _gemm_weight(k)})
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not _gemm_weight(k)]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path}: checkpoint keys do not fit the model: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    for name, module in list(model.named_modules()):  # computed buffers (rotary inv_freq) were made on meta
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, type(module)(config=config))
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    return model


def _return_free_memory() -> None:
    """Hands freed heap memory back to the OS (glibc keeps it otherwise; measured on the default
    model: RSS 968 -> 967 MiB after freeing 203 MiB of weights, 736 MiB after malloc_trim)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _native(model: nn.Module, quantize: str = "", head_ids: torch.Tensor | None = None, model_dir=None):
    """(FastLlama, "native") when the native kernels can run `model` here, else (None, why not)."""
    import logging

    from specsplit.model import fastllama

    reason = fastllama.unsupported_reason(model)
    if reason is None:
        try:
            native = fastllama.FastLlama(model, quantize=quantize, head_ids=head_ids, model_dir=model_dir)
        except FileNotFoundError:  # --quantize gguf without a model.gguf: the user's to fix
            raise
        except (RuntimeError, OSError) as e:  # no compiler, a failed build
            reason = f"the native kernels did not build: {e}"
        else:
            return native, "native" + (f" {quantize}" if quantize else "")
    logging.getLogger("specsplit").info("forward: transformers (%s)", reason)
    return None, f"transformers ({reason})"


class Sequence(Rollback, Protocol):
    """One sequence's KV cache: tokens fed are appended at positions [length, length + n);
    truncate(length) rolls back by position (specsplit.speculation.rollback)."""

    def forward(self, token_ids: list[int], last_only: bool = False) -> torch.Tensor: ...

    def hidden(self, token_ids: list[int]) -> torch.Tensor: ...

    def forward_with_features(self, token_ids: list[int],
                              last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...

    def free(self) -> None:
        """The sequence is done: what its cache holds goes back now."""


def KVSequence(lm: LoadedModel) -> Sequence:
    """A new KV-cached sequence on a loaded model: on the native kernels when load_model prepared
    them, else on transformers' forward (HFSequence). Both have the same interface."""
    return lm.native.sequence() if lm.native is not None else HFSequence(lm.model)


class HFSequence:
    """One sequence's KV cache on transformers' forward. The cache holds keys/values for the first
    `length` tokens fed to it; rolling back is truncation by position."""

    def __init__(self, model: nn.Module):
        from transformers import DynamicCache

        self._model = model
        self._cache = DynamicCache(config=model.config)

    @property
    def length(self) -> int:
        return self._cache.get_seq_length()

    def truncate(self, length: int) -> None:
        rollback.check(self.length, length)
        if length < self.length:
            self._cache.crop(length - self.length)  # a negative count: drop that many

    def free(self) -> None:
        """No budget to give back (transformers' cache is not accounted); its tensors go now."""
        from transformers import DynamicCache

        self._cache = DynamicCache(config=self._model.config)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Append `token_ids` at positions [length, length+n) and return float32 logits
        [n, vocab] (or [1, vocab] with last_only)."""
        device = self._model.device
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)  # [1, n]
        out = self._model(input_ids=ids, cache=self._cache, use_cache=True,
                          logits_to_keep=1 if last_only else 0)
        return out.logits[0].float()  # [n or 1, vocab]

    @torch.inference_mode()
    def hidden(self, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids` and return their features (final-norm hidden states) [n, hidden],
        without the output head."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self._model.device)  # [1, n]
        base = getattr(self._model, self._model.base_model_prefix)
        return base(input_ids=ids, cache=self._cache, use_cache=True).last_hidden_state[0]

    @torch.inference_mode()
    def forward_with_features(self, token_ids: list[int], last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(), also returning the features [n, hidden] of every fed token. Logits are
        lm_head(features), the same arithmetic as the Llama-family *ForCausalLM forward (models
        that post-process logits, e.g. soft-capping, are not supported for feature drafting)."""
        hidden = self.hidden(token_ids)
        rows = hidden[-1:] if last_only else hidden
        return self._model.get_output_embeddings()(rows).float(), hidden
