"""The target's fast, exact forward: Llama-family decoders (llama, mistral without a sliding
window, qwen2) on the native kernels (specsplit/model/native/decoder.cpp), with a static KV cache per
sequence written by position, so rolling back is a length change.

Exact: a row's logits do not depend on the other rows in the call (nor on the thread count), so
verifying k drafted tokens gives bit-identical logits to decoding them one by one; the kernels
are built that way (docs/architecture.md, "Target forward"). The caches are plain tensors owned
by their sequences and accounted against one budget (KVPool). `FastLlama.run` feeds several
sequences' rows in one call (a batching verifier): every row's logits are those its sequence would
get alone.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specsplit.model import native
from specsplit.speculation import rollback

SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
# "": the model's own dtype; "int8": int8 weights per output row, widened to bf16 (bf16 models);
# "q8_0": int8 weights per output and block of 32 by int8 activations per row and block (VNNI);
# "q4_0": 4-bit weights per block of 32 (llama.cpp's Q4_0 rounding), the same int8 activations;
# "gguf": the blocks of the model directory's model.gguf as shipped (specsplit.ggufweights).
QUANTIZE = {"": 0, "int8": 1, "q8_0": 2, "q4_0": 3, "gguf": 2}


class CacheFull(RuntimeError):
    """The KV budget cannot hold what a sequence needs (the service answers RESOURCE_EXHAUSTED)."""


def unsupported_reason(model: nn.Module) -> str | None:
    """None if `model` can run on the native forward here, else why not (it then runs on
    transformers' own, exact but slower)."""
    config = model.config
    arch = type(model).__name__
    if arch not in SUPPORTED:
        return f"{arch} is not one of {sorted(SUPPORTED)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False) or getattr(model.model.layers[0].self_attn.o_proj, "bias", None) is not None:
        return "biases outside the QKV projection"
    if getattr(config, "sliding_window", None) and (arch == "MistralForCausalLM"
                                                    or getattr(config, "use_sliding_window", False)):
        return "sliding-window attention"
    if config.intermediate_size % 16:
        return "intermediate size not a multiple of 16"
    weight = model.get_input_embeddings().weight
    return native.unavailable(weight.dtype, weight.device)


def _packer(quantize: str, config, model_dir: str | None):
    """(pack, the GGUF file's weights or None): pack(gguf names, the transformers weight, merge=None,
    rows=None) -> a packed weight, from the float weight (quantized as asked), or for "gguf" from
    the file's blocks."""
    code = QUANTIZE[quantize]

    def from_weights(names, weight, merge=None, rows=None):
        return dense(weight if rows is None else weight[rows].contiguous(), code)

    if quantize != "gguf":
        return from_weights, None
    from specsplit.model.ggufweights import GGUFWeights, gguf_path

    if model_dir is None:
        raise ValueError("--quantize gguf needs the model directory (its model.gguf)")
    weights = GGUFWeights(gguf_path(model_dir), config)

    def from_file(names, weight, merge=None, rows=None):
        if names[0] == "output.weight":  # a tied head is the file's token embedding
            names = [names[0] if names[0] in weights.tensors else names[1]]
        return weights.weight(names, native.module(), merge, rows)

    return from_file, weights


def dense(weight: torch.Tensor, quant: int = 0):
    """A float weight [outputs, inputs] packed for the kernels (quant: a QUANTIZE code); bf16 on
    AMX tiles where native.amx()."""
    return native.module().Weight.dense(weight.detach(), quant, native.amx())


def kernel_name(quantize: str, dtype: torch.dtype) -> str:
    """What multiplies the weights, on which kernel path, for logs and the bench header."""
    path = native.isa()[0]
    if path in native.AVX2_CODE:
        isa = "AVX2" if path == "avx2" else "AVX2 on NEON"
        if quantize in ("q8_0", "q4_0", "gguf"):
            return f"{quantize} x int8 rows, {isa} vpmaddubsw"
        if quantize == "int8":
            return f"int8 widened to fp32, {isa} FMA"
        return f"{'bf16 widened to fp32' if dtype == torch.bfloat16 else 'fp32'}, {isa} FMA"
    if quantize in ("q8_0", "q4_0", "gguf"):
        return f"{quantize} x int8 rows, AVX-512 VNNI vpdpbusd"
    if quantize == "int8":
        return "int8 widened to bf16, AVX-512 vdpbf16ps"
    if dtype == torch.bfloat16:
        return "bf16, AMX tdpbf16ps" if native.amx() else "bf16, AVX-512 vdpbf16ps"
    return "fp32, AVX-512 FMA"


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate and up rows interleaved by 16 (panel 2j: gate rows 16j.., panel 2j+1: up rows), so one
    GEMM yields both and the kernels pair SiLU(gate) with up panel by panel. Works on any tensor
    whose first dimension is the output rows (weights, or a block format's blocks)."""
    inter = gate.shape[0]
    if inter % 16:
        raise ValueError(f"intermediate size {inter} is not a multiple of 16")
    rest = tuple(gate.shape[1:])
    return torch.stack([gate.reshape(inter // 16, 16, *rest), up.reshape(inter // 16, 16, *rest)], 1) \
        .reshape(2 * inter, *rest)


class KVPool:
    """Accounts the bytes every sequence's cache holds against one budget. Thread-safe. `reclaim`
    (set by a prefix cache) is asked to give back bytes before a take would fail, so kept prefixes
    only ever use room that sessions do not need."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.reclaim: Callable[[int], None] | None = None  # reclaim(bytes wanted): give() back what it can
        self._lock = threading.RLock()

    def take(self, nbytes: int, what: str) -> None:
        with self._lock:
            over = self.used_bytes + nbytes - self.budget_bytes
            if over > 0 and self.reclaim is not None:
                self.reclaim(over)
            if self.used_bytes + nbytes > self.budget_bytes:
                raise CacheFull(f"{what} needs {nbytes / 2**20:.1f} MiB more KV cache; "
                                f"{self.used_bytes / 2**20:.1f} of {self.budget_bytes / 2**20:.1f} MiB are in use")
            self.used_bytes += nbytes

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes -= nbytes


class FastLlama:
    """The packed weights of one model (the native decoder) and the KV budget of its sequences."""

    def __init__(self, model: nn.Module, quantize: str = "", head_ids: torch.Tensor | None = None,
                 model_dir: str | None = None):
        """quantize: one of QUANTIZE (every GEMM weight, the head included).
        head_ids: the output head keeps only these vocabulary rows (a drafter's draft vocabulary:
        logits come in that order). model_dir: where quantize "gguf" finds model.gguf."""
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"no native forward for this model: {reason}")
        if quantize not in QUANTIZE:
            raise ValueError(f"unknown quantization {quantize!r}; choose one of {sorted(QUANTIZE)}")
        if quantize in ("q8_0", "q4_0", "gguf") and native.lacks_vnni():
            raise ValueError(f"--quantize {quantize} needs AVX-512 VNNI on this path: {native.lacks_vnni()}")
        config, base = model.config, model.model
        embed = base.embed_tokens.weight.detach()
        self.dtype, self.device = embed.dtype, embed.device
        self.layers = config.num_hidden_layers
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 2048)
        head = model.get_output_embeddings().weight.detach()
        with torch.no_grad():  # cos/sin for every position, as transformers computes them
            cos, sin = base.rotary_emb(embed[:1].float(), torch.arange(self.max_context)[None])
        pack, file = _packer(quantize, config, model_dir)
        self.decoder = native.module().Decoder(
            config.num_attention_heads, self.kv_heads, self.head_dim, float(config.rms_norm_eps), embed,
            cos[0], sin[0], base.norm.weight.detach(),
            pack(["output.weight", "token_embd.weight"], head, rows=head_ids), native.amx())
        self.quantize = quantize
        self.kernel = kernel_name(quantize, self.dtype)
        empty = torch.empty(0)
        for i, layer in enumerate(base.layers):
            att, mlp = layer.self_attn, layer.mlp
            bias = empty if att.q_proj.bias is None else torch.cat([att.q_proj.bias, att.k_proj.bias,
                                                                     att.v_proj.bias]).detach()
            blk = f"blk.{i}."
            self.decoder.add_layer(
                pack([blk + "attn_q.weight", blk + "attn_k.weight", blk + "attn_v.weight"],
                     torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])),
                bias, pack([blk + "attn_output.weight"], att.o_proj.weight),
                pack([blk + "ffn_gate.weight", blk + "ffn_up.weight"],
                     interleave(mlp.gate_proj.weight, mlp.up_proj.weight), merge=interleave),
                pack([blk + "ffn_down.weight"], mlp.down_proj.weight), layer.input_layernorm.weight.detach(),
                layer.post_attention_layernorm.weight.detach())
        if file is not None:
            import logging

            logging.getLogger("specsplit").info(
                "gguf weights as shipped: %s; re-quantized to q8_0 (type not served): %s",
                ", ".join(f"{k} x{v}" for k, v in sorted(file.kinds().items())), ", ".join(file.requantized) or "none")
        self.token_bytes = 2 * self.layers * self.kv_heads * self.head_dim * embed.element_size()
        self.pool = KVPool(1 << 62)  # unbounded until the service sets its budget (LoadedModel.set_kv_budget)

    def sequence(self) -> FastSequence:
        return FastSequence(self)

    def run(self, feeds: list[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward over every feed's rows (each appended to its own sequence's cache, room
        reserved by the caller with `FastSequence.reserve`); per feed (logits, features) as
        FastSequence.forward_with_features returns them."""
        return [(logits, hidden) for logits, hidden, _ in self.run_choosing(feeds)]

    def run_choosing(self, feeds: list[Feed]) -> list[tuple[torch.Tensor | None, torch.Tensor, list[int] | None]]:
        """As run, with each logits row's argmax (torch.argmax's choice), taken by the forward's own
        threads while the rows are in their caches: per feed (logits, features, choices)."""
        ids = torch.tensor([t for f in feeds for t in f.token_ids], dtype=torch.long)
        buffers = [f.sequence._buffer for f in feeds]
        trees = [torch.tensor(f.parents if f.parents is not None else [], dtype=torch.long) for f in feeds]
        starts = [b.length for b in buffers]
        counts, heads = [len(f.token_ids) for f in feeds], [f.head_mode for f in feeds]
        logits, hidden, choices = self.decoder.forward_batch(ids, _NONE, [b.kv for b in buffers], starts, counts,
                                                             heads, trees, starts, [_NONE] * len(feeds))
        chosen = choices.tolist() if choices is not None else []  # None: no feed asked for logits
        out, row, at = [], 0, 0
        for feed, buffer in zip(feeds, buffers):
            n = len(feed.token_ids)
            heads = (0, 1, n)[feed.head_mode]
            out.append((logits[at:at + heads] if heads else None, hidden[row:row + n],
                        chosen[at:at + heads] if heads else None))
            buffer.length += n
            row, at = row + n, at + heads
        return out


@dataclass(frozen=True)
class Feed:
    """One sequence's rows in a batched forward: token ids appended at its length, logits of the last
    row only or of all (or none: features only), and an optional token tree (as
    FastSequence.forward's parents)."""

    sequence: FastSequence
    token_ids: list[int]
    last_only: bool = False
    parents: list[int] | None = None
    logits: bool = True

    @property
    def head_mode(self) -> int:
        return 0 if not self.logits else 1 if self.last_only else 2


_NONE = torch.empty(0, dtype=torch.long)
_CHUNK = 256  # a cache grows by at least this many positions (and at least doubles)


class KVBuffer:
    """A static KV cache [layers, 2, capacity, kv_heads, head_dim] as the native kernels read it,
    written by position: `length` positions hold keys and values, rolling back is a length change.
    Capacity grows by doubling; with a pool, the bytes are taken from it and given back when the
    buffer is collected. Shared by the target's sequences and the self-draft head's caches."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, max_positions: int,
                 pool: KVPool | None = None):
        self.kv = torch.zeros(layers, 2, 0, kv_heads, head_dim, dtype=dtype)
        self.length = 0
        self.max_positions = max_positions
        self._pool = pool
        self._held = [0]
        if pool is not None:
            weakref.finalize(self, _give_back, pool, self._held)

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]

    def free(self) -> None:
        """Gives its bytes back to the pool now, not when the buffer is collected (a reference kept
        a little longer, by a decode still winding down or a cycle, held the budget beside a busy
        neighbour: a released session's 1 MiB refused the next request); empty after, as if new."""
        if self._pool is not None:
            self._pool.give(self._held[0])
            self._held[0] = 0
        self.kv = self.kv.new_zeros(*self.kv.shape[:2], 0, *self.kv.shape[3:])
        self.length = 0

    def truncate(self, length: int) -> None:
        """specsplit.speculation.rollback's contract."""
        rollback.check(self.length, length)
        self.length = length

    def reserve(self, end: int) -> None:
        """Room for positions [0, end)."""
        if end > self.max_positions:
            raise ValueError(f"{end} positions exceed the context of {self.max_positions}")
        if end <= self.capacity:
            return
        capacity = min(self.max_positions, max(end, 2 * self.capacity, _CHUNK))
        layers, _, _, kv_heads, head_dim = self.kv.shape
        if self._pool is not None:
            extra = (capacity - self.capacity) * layers * 2 * kv_heads * head_dim * self.kv.element_size()
            self._pool.take(extra, f"a sequence of {end} tokens")
            self._held[0] += extra
        # Uninitialised: slots past `length` are never read (and their pages are faulted in as the
        # prefill writes them, not all at once here).
        kv = torch.empty(layers, 2, capacity, kv_heads, head_dim, dtype=self.kv.dtype)
        kv[:, :, :self.length] = self.kv[:, :, :self.length]
        self.kv = kv

    def keep(self, start: int, rows: list[int]) -> None:
        """After a token-tree call that wrote slots [start, length): keep the rows `rows` (one path,
        ascending) at positions start, start + 1, ... and drop the rest, so the cache again holds one
        sequence by position."""
        if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and (rows[0] < 0 or start + rows[-1] >= self.length)):
            raise ValueError(f"rows {rows} are not an ascending path inside the {self.length - start} written")
        moved = [i for i, r in enumerate(rows) if r != i]
        if moved:  # rows[i] >= i: ascending copies never overwrite a slot still to be read
            src = torch.tensor([start + rows[i] for i in moved])
            self.kv[:, :, torch.tensor(moved) + start] = self.kv[:, :, src]
        self.length = start + len(rows)


class FastSequence:
    """One sequence's KV cache on the native forward (a KVBuffer accounted in the model's pool)."""

    def __init__(self, lm: FastLlama):
        self._lm = lm
        self._buffer = KVBuffer(lm.layers, lm.kv_heads, lm.head_dim, lm.dtype, lm.max_context, lm.pool)

    @property
    def length(self) -> int:
        return self._buffer.length

    @property
    def capacity(self) -> int:
        return self._buffer.capacity

    def truncate(self, length: int) -> None:
        self._buffer.truncate(length)

    def free(self) -> None:
        """The sequence is done: its cache's bytes back to the budget now (KVBuffer.free)."""
        self._buffer.free()

    def keep(self, start: int, rows: list[int]) -> None:
        self._buffer.keep(start, rows)

    def reserve(self, rows: int) -> None:
        """Room for `rows` more positions (CacheFull when the budget cannot give it)."""
        self._buffer.reserve(self._buffer.length + rows)

    def read(self, start: int, end: int) -> torch.Tensor:
        """A copy of the keys and values of positions [start, end): [layers, 2, n, kv_heads, head_dim]."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"positions [{start}, {end}) are not inside the {self.length} cached")
        return self._buffer.kv[:, :, start:end].clone()

    def append(self, kv: torch.Tensor) -> None:
        """Writes keys and values read from a sequence of the same model at positions [length, length + n)."""
        buffer, n = self._buffer, kv.shape[2]
        buffer.reserve(buffer.length + n)
        buffer.kv[:, :, buffer.length:buffer.length + n] = kv
        buffer.length += n

    def _run(self, token_ids: list[int], head: int, parents: list[int] | None = None):
        buffer = self._buffer
        start = buffer.length
        buffer.reserve(start + len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.long)
        tree = torch.tensor(parents if parents is not None else [], dtype=torch.long)
        logits, hidden, _ = self._lm.decoder.forward(ids, buffer.kv, start, head, tree, start, _NONE)
        buffer.length = start + len(token_ids)
        return logits, hidden

    def forward(self, token_ids: list[int], last_only: bool = False,
                parents: list[int] | None = None) -> torch.Tensor:
        """Append `token_ids` at positions [length, length+n) and return float32 logits
        [n, vocab] (or [1, vocab] with last_only). parents: a token tree (row -> earlier row,
        -1: child of the cached prefix); row r then sits at its depth and sees only its path, and
        `keep` afterwards keeps one path."""
        return self._run(token_ids, 1 if last_only else 2, parents)[0]

    def hidden(self, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids` and return their features (final-norm hidden states) [n, hidden]."""
        return self._run(token_ids, 0)[1]

    def forward_with_features(self, token_ids: list[int], last_only: bool = False,
                              parents: list[int] | None = None):
        return self._run(token_ids, 1 if last_only else 2, parents)


def _give_back(pool: KVPool, held: list[int]) -> None:
    pool.give(held[0])
