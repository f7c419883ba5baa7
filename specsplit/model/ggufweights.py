"""A GGUF file's own quantized blocks for the native kernels (`--quantize gguf`): Q4_0, Q4_1 and
Q8_0 tensors are served as shipped, block for block (their quality is exactly the file's); a tensor
of another type is re-quantized to q8_0 from the model directory's weights (which are that tensor
dequantized), and the loader says which.

The file is the model directory's `model.gguf` (the catalog links it for the embedded default;
any directory may hold one). llama.cpp stores a llama model's q and k rows permuted for its rotary
layout; they are put back in transformers' order here, blocks and all."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("specsplit")

GGUF_FILE = "model.gguf"
BLOCK = 32
SERVED = ("Q4_0", "Q4_1", "Q8_0")  # block formats the kernels multiply as they are


def gguf_path(model_dir: str | Path) -> Path:
    path = Path(model_dir) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--quantize gguf serves the blocks of {path}, which is not there: link the GGUF "
                                "file the directory was converted from as model.gguf")
    return path


class GGUFWeights:
    """The packed weights of one model from its GGUF file; `weight(name, hf_weight)` packs one
    matrix (rows in transformers' order) as the file has it."""

    def __init__(self, path: Path, config):
        from gguf import GGUFReader

        self.reader = GGUFReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch = self.reader.fields.get("general.architecture")
        self.arch = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else ""
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.requantized: list[str] = []

    def kinds(self) -> dict[str, int]:
        """How many matrices each block format served."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    def blocks(self, name: str) -> tuple[str, dict[str, torch.Tensor]] | None:
        """(type, its parts as [rows, blocks, ...] tensors, rows in transformers' order), or None
        when the file has no such tensor or not in a served type."""
        t = self.tensors.get(name)
        if t is None or t.tensor_type.name not in SERVED:
            return None
        kind = t.tensor_type.name
        raw = np.asarray(t.data)  # [rows, bytes per row]
        rows = raw.shape[0]
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
        b = torch.from_numpy(raw.reshape(rows, -1, size).copy())
        half = lambda lo: b[:, :, lo:lo + 2].contiguous().view(torch.float16)[..., 0].float()  # noqa: E731
        if kind == "Q4_0":
            parts = {"d": half(0), "nibbles": b[:, :, 2:18].contiguous()}
        elif kind == "Q4_1":
            parts = {"d": half(0), "m": half(2), "nibbles": b[:, :, 4:20].contiguous()}
        else:
            parts = {"d": half(0), "q": b[:, :, 2:34].contiguous().view(torch.int8)}
        order = self._row_order(name, rows)
        if order is not None:
            parts = {k: v[order] for k, v in parts.items()}
        return kind, parts

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """llama.cpp permutes a llama model's q and k rows (per head: the two rotary halves
        interleaved); the inverse of that permutation, else None."""
        if self.arch != "llama" or not (name.endswith("attn_q.weight") or name.endswith("attn_k.weight")):
            return None
        heads = self.heads if name.endswith("attn_q.weight") else self.kv_heads
        index = torch.arange(rows)
        return index.reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)

    def weight(self, names: list[str], hf: torch.Tensor, native, interleave=None, rows: torch.Tensor | None = None):
        """One packed matrix from the file's tensors `names` stacked by rows (q, k, v) or, with
        `interleave`, gate and up interleaved by panel, optionally only `rows` of it (a draft
        vocabulary); `hf` is the same matrix from the model directory, re-quantized to q8_0 where
        the file's type is not served."""
        if rows is not None:
            hf = hf[rows]
        found = [self.blocks(n) for n in names]
        kinds = {f[0] for f in found if f is not None}
        if None in found or len(kinds) != 1:
            self.requantized += names
            return native.Weight.dense(hf.detach(), 2)
        kind = kinds.pop()
        parts = {k: [f[1][k] for f in found] for k in found[0][1]}
        if interleave is not None:
            merged = {k: interleave(*v) for k, v in parts.items()}
        else:
            merged = {k: torch.cat(v) for k, v in parts.items()}
        if rows is not None:
            merged = {k: v[rows].contiguous() for k, v in merged.items()}
        inputs = hf.shape[1]
        if kind == "Q8_0":
            return native.Weight.q8_0(merged["q"], merged["d"], inputs)
        if kind == "Q4_0":
            return native.Weight.q4_0(merged["nibbles"], merged["d"], inputs)
        return native.Weight.q4_1(merged["nibbles"], merged["d"], merged["m"], inputs)


def dequantize(kind: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float weights [rows, inputs] that blocks stand for (tests compare them with the model
    directory's, which transformers dequantized from the same file)."""
    if kind == "Q8_0":
        return (parts["q"].float() * parts["d"].unsqueeze(2)).flatten(1)
    n = parts["nibbles"].to(torch.int32)
    u = torch.cat([n & 15, n >> 4], 2).float()  # inputs 0..15, then 16..31 of each block
    if kind == "Q4_0":
        return ((u - 8) * parts["d"].unsqueeze(2)).flatten(1)
    return (u * parts["d"].unsqueeze(2) + parts["m"].unsqueeze(2)).flatten(1)
