"""A GGUF file's own quantized blocks for the native kernels (`--quantize gguf`): Q4_0, Q4_1,
Q4_K, Q5_0, Q6_K and Q8_0 tensors are served with the file's values exactly (their quality is the
file's), unpacked once into one of the kernels' block layouts:
- Q4_0, Q4_1, Q8_0 as they are;
- Q4_K (super-blocks of 256: 8 blocks of 32 with 6-bit scales and mins) as Q4_1 blocks, d = d * sc
  and m = -dmin * min, kept factored (sc and min as int8, d and -dmin as float16 per 256 inputs) and
  multiplied out in the GEMM (exact in float32): 4.6 bits a weight;
- Q5_0 (5-bit values) as Q8_0 blocks of int8 values, the same d;
- Q6_K (super-blocks of 256: 16 groups of 16 with int8 scales) as Q8_16: int8 values with a scale
  per 16 inputs, d * sc (exact; factored as Q4_K's).
The 5- and 6-bit values then stream as 8 bits: the same numbers, more bytes. A tensor of another
type is dequantized and re-quantized to q8_0, and the loader says which. The model directory's
copy of these weights is never read (modeling loads it without them).

The file is the model directory's `model.gguf` (the catalog links it for the embedded default;
any directory may hold one). llama.cpp stores a llama model's q and k rows permuted for its rotary
layout; they are put back in transformers' order here, blocks and all."""

from __future__ import annotations

import logging
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

log = logging.getLogger("specsplit")

GGUF_FILE = "model.gguf"
BLOCK = 32
SERVED = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")  # file types served with their own values


def gguf_path(model_dir: str | Path) -> Path:
    path = Path(model_dir) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--quantize gguf serves the blocks of {path}, which is not there: link the GGUF "
                                "file the directory was converted from as model.gguf")
    return path


class GGUFWeights:
    """The packed weights of one model from its GGUF file; `weight(name, hf_weight)` packs one
    matrix (rows in transformers' order) as the file has it."""

    def __init__(self, path: Path, config, factored: bool = True, narrow: bool = True):
        """factored: K-quant scales travel as the file keeps them (int8 factors of a float16 base per
        256 inputs), else as their float32 products. narrow: 6-bit values (Q6_K, and Q4_K stacked
        with it) stream as 6 bits (q6_h), else as 8 (q8_h). Either way the same values and bits:
        tests compare them."""
        self.arch, self.tensors = read(path)
        self.factored, self.narrow = factored, narrow
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.requantized: list[str] = []

    def kinds(self) -> dict[str, int]:
        """How many matrices each block format served."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.kind] = counts.get(t.kind, 0) + 1
        return counts

    def blocks(self, name: str) -> tuple[str, dict[str, torch.Tensor]] | None:
        """(layout, its parts as [rows, blocks, ...] tensors, rows in transformers' order), or None
        when the file has no such tensor or not in a served type; the layout is the kernels' (Q4_0,
        Q4_1, Q8_0 or Q8_16), which the file's type was unpacked into."""
        t = self.tensors.get(name)
        if t is None or t.kind not in SERVED:
            return None
        raw = np.asarray(t.data)  # [rows, bytes per row]
        kind, parts = unpack(t.kind, torch.from_numpy(raw.copy()))
        order = self._row_order(name, raw.shape[0])
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

    def weight(self, names: list[str], native, interleave=None, rows: torch.Tensor | None = None):
        """One packed matrix from the file's tensors `names` stacked by rows (q, k, v) or, with
        `interleave`, gate and up interleaved by panel, optionally only `rows` of it (a draft
        vocabulary). A tensor of a type the kernels do not serve is dequantized and re-quantized to
        q8_0 (the loader says which)."""
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise ValueError(f"the GGUF file has no tensor {', '.join(missing)}")
        found = [self.blocks(n) for n in names]
        if None in found:
            self.requantized += names
            values = [self._dequantized(n) for n in names]
            merged = interleave(*values) if interleave is not None else torch.cat(values)
            return native.Weight.dense(merged if rows is None else merged[rows].contiguous(), 2, False)
        if len({f[0] for f in found}) > 1:  # mixed types stacked (a Q6_K v beside Q4_K q and k): widened
            found = [widen(*f) for f in found]
        kind = found[0][0]
        parts = {k: [f[1][k] for f in found] for k in found[0][1]}
        if interleave is not None:
            merged = {k: interleave(*v) for k, v in parts.items()}
        else:
            merged = {k: torch.cat(v) for k, v in parts.items()}
        if rows is not None:
            merged = {k: v[rows].contiguous() for k, v in merged.items()}
        inputs = self.tensors[names[0]].inputs
        if kind == "Q8_0":
            return native.Weight.q8_0(merged["q"], merged["d"], inputs)
        if kind == "Q4_0":
            return native.Weight.q4_0(merged["nibbles"], merged["d"], inputs)
        d, m, bases = merged["d"], merged.get("m"), {}
        if self.factored and "d_base" in merged:  # K-quants: int8 factors of a float16 base, as the file has them
            d, m = merged["d_factor"], merged.get("m_factor")
            bases = {"d_base": merged["d_base"], "m_base": merged.get("m_base")}
        if kind == "Q8_16":
            return native.Weight.q8_h(merged["q"], d, m, inputs, **bases, narrow=self.narrow)
        return native.Weight.q4_1(merged["nibbles"], d, m, inputs, **bases)

    def _dequantized(self, name: str) -> torch.Tensor:
        """A tensor's float32 values [rows, inputs], rows in transformers' order."""
        from gguf import GGMLQuantizationType, quants

        t = self.tensors[name]
        values = quants.dequantize(np.asarray(t.data), GGMLQuantizationType[t.kind])
        values = torch.from_numpy(np.ascontiguousarray(values, np.float32)).reshape(-1, t.inputs)
        order = self._row_order(name, values.shape[0])
        return values if order is None else values[order]


class Tensor(NamedTuple):
    name: str
    kind: str  # ggml's type name: "Q4_K", "F16", ...
    inputs: int  # ggml's ne[0]
    data: np.ndarray  # the file's bytes, mapped: [rows, bytes per row]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Header:
    """Reads a GGUF header in order: scalars, strings, and metadata values skipped by type."""

    def __init__(self, buf: memoryview):
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def text(self) -> str:
        n = self.take("<Q")
        if self.at + n > len(self.buf):
            raise ValueError(f"a {n}-byte string at byte {self.at} runs past the end")
        self.at += n
        return bytes(self.buf[self.at - n:self.at]).decode()

    def value(self, vtype: int) -> object:
        """A metadata value: strings and scalars read, arrays skipped (None)."""
        if vtype == 8:
            return self.text()
        if vtype == 9:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALARS:
                self.at += count * struct.calcsize(_SCALARS[etype])
            else:
                for _ in range(count):
                    self.value(etype)
            return None
        return self.take(_SCALARS[vtype])


def read(path: Path) -> tuple[str, dict[str, Tensor]]:
    """(general.architecture, the tensors by name) of a GGUF file (format v2/v3), the data mapped,
    not read. gguf's own GGUFReader parses every metadata value into numpy views: 20 s for the
    1.5B's 151,643-token vocabulary, of a 40 s load. Here values are skipped, not kept. A file cut
    short (a download that stopped) is refused saying so, not with a reshape error."""
    if Path(path).stat().st_size < 4:  # (an empty file cannot even be mapped)
        raise ValueError(f"{path} is not a GGUF file")
    blob = np.memmap(path, mode="r")
    header = _Header(memoryview(blob))
    if header.take("<I") != 0x46554747:  # b"GGUF"
        raise ValueError(f"{path} is not a GGUF file")
    try:
        return _tensors(path, blob, header)
    except (struct.error, UnicodeDecodeError, KeyError, ValueError) as e:
        raise ValueError(f"{path} is a truncated or corrupt GGUF file ({len(blob)} bytes): {e}") from None


def _tensors(path: Path, blob: np.memmap, header: _Header) -> tuple[str, dict[str, Tensor]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if header.take("<I") not in (2, 3):
        raise ValueError(f"{path}: GGUF version not read here (2 and 3 are)")
    count, fields = header.take("<Q"), header.take("<Q")
    meta = {}
    for _ in range(fields):
        key = header.text()
        value = header.value(header.take("<I"))
        if key in ("general.architecture", "general.alignment"):
            meta[key] = value
    infos = []
    for _ in range(count):
        name = header.text()
        dims = [header.take("<Q") for _ in range(header.take("<I"))]
        infos.append((name, dims, GGMLQuantizationType(header.take("<I")), header.take("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = (header.at + align - 1) // align * align
    tensors = {}
    for name, dims, kind, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        rows, row_bytes = int(np.prod(dims[1:], dtype=np.int64)), dims[0] // block * size
        end = start + offset + rows * row_bytes
        if end > len(blob):
            raise ValueError(f"tensor {name} ends at byte {end}, past the end of the file")
        data = blob[start + offset:end].reshape(rows, row_bytes)
        tensors[name] = Tensor(name, kind.name, int(dims[0]), data)
    return str(meta.get("general.architecture", "")), tensors


def unpack(kind: str, b: torch.Tensor) -> tuple[str, dict[str, torch.Tensor]]:
    """A tensor's raw bytes [rows, bytes per row] of GGUF type `kind` as (layout, parts) in one of
    the kernels' block layouts, with the file's values exactly (the bit layouts are ggml's)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rows = b.shape[0]
    b = b.reshape(rows, -1, GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1])  # bytes a (super-)block
    half = lambda lo: b[:, :, lo:lo + 2].contiguous().view(torch.float16)[..., 0].float()  # noqa: E731
    if kind == "Q4_0":
        return kind, {"d": half(0), "nibbles": b[:, :, 2:18].contiguous()}
    if kind == "Q4_1":
        return kind, {"d": half(0), "m": half(2), "nibbles": b[:, :, 4:20].contiguous()}
    if kind == "Q8_0":
        return kind, {"d": half(0), "q": b[:, :, 2:34].contiguous().view(torch.int8)}
    if kind == "Q5_0":  # d, 32 high bits (input j: bit j), 16 bytes of low nibbles (inputs j, j + 16)
        high = b[:, :, 2:6].to(torch.int64)
        bits = (high[..., 0] | high[..., 1] << 8 | high[..., 2] << 16 | high[..., 3] << 24).unsqueeze(2)
        bits = (bits >> torch.arange(32)) & 1
        qs = b[:, :, 6:22]
        low = torch.cat([qs & 15, qs >> 4], 2).to(torch.int64)
        return "Q8_0", {"d": half(0), "q": (low | bits << 4).sub(16).to(torch.int8)}
    if kind == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and mins, 4 x 32 bytes (blocks 2g, 2g + 1: nibbles)
        sc = b[:, :, 4:16].to(torch.int64)
        lo, hi, mix = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
        scales = torch.cat([lo & 63, (mix & 15) | (lo >> 2 & 48)], 2)
        mins = torch.cat([hi & 63, (mix >> 4) | (hi >> 2 & 48)], 2)
        qs = b[:, :, 16:144].reshape(rows, -1, 4, 1, 32)
        u = torch.cat([qs & 15, qs >> 4], 3).reshape(rows, -1, 32)  # [rows, blocks, 32]
        return "Q4_1", {"d": (half(0).unsqueeze(2) * scales).reshape(rows, -1),
                        "m": (-(half(2).unsqueeze(2) * mins)).reshape(rows, -1),
                        "nibbles": (u[..., :16] | u[..., 16:] << 4).contiguous(),
                        "d_factor": scales.reshape(rows, -1).to(torch.int8), "d_base": half(0).half(),
                        "m_factor": mins.reshape(rows, -1).to(torch.int8), "m_base": -half(2).half()}
    # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16), d
    ql = b[:, :, 0:128].reshape(rows, -1, 2, 1, 64)
    ql = torch.cat([ql & 15, ql >> 4], 3).reshape(rows, -1, 8, 32)
    qh = b[:, :, 128:192].reshape(rows, -1, 2, 1, 32)
    qh = torch.cat([qh & 3, qh >> 2 & 3, qh >> 4 & 3, qh >> 6 & 3], 3).reshape(rows, -1, 8, 32)
    q = (ql.to(torch.int16) | qh.to(torch.int16) << 4).sub(32).to(torch.int8).reshape(rows, -1, 32)
    scales = b[:, :, 192:208].contiguous().view(torch.int8)
    return "Q8_16", {"d": (half(208).unsqueeze(2) * scales.float()).reshape(rows, -1, 2), "q": q,
                     "d_factor": scales.reshape(rows, -1, 2), "d_base": half(208).half()}


def widen(kind: str, parts: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
    """Any layout as Q8_16 with mins (int8 values, a scale per 16 inputs, m per block), the same
    values: what tensors of different types stacked in one matrix share."""
    if kind == "Q8_16":
        q, d, m = parts["q"], parts["d"], parts.get("m")
    elif kind == "Q8_0":
        q, d, m = parts["q"], parts["d"].unsqueeze(2).expand(-1, -1, 2), None
    else:
        n = parts["nibbles"].to(torch.int16)
        q = torch.cat([n & 15, n >> 4], 2) - (8 if kind == "Q4_0" else 0)
        q, d, m = q.to(torch.int8), parts["d"].unsqueeze(2).expand(-1, -1, 2), parts.get("m")
    return "Q8_16", {"q": q, "d": d.contiguous(), "m": torch.zeros(q.shape[:2]) if m is None else m}


def dequantize(kind: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float weights [rows, inputs] that blocks stand for (tests compare them with the model
    directory's, which transformers dequantized from the same file, and with gguf's own)."""
    if kind == "Q8_0":
        return (parts["q"].float() * parts["d"].unsqueeze(2)).flatten(1)
    if kind == "Q8_16":
        q = parts["q"].float().unflatten(2, (2, 16))
        w = (q * parts["d"].unsqueeze(3)).flatten(2)
        return (w + parts["m"].unsqueeze(2) if "m" in parts else w).flatten(1)
    n = parts["nibbles"].to(torch.int32)
    u = torch.cat([n & 15, n >> 4], 2).float()  # inputs 0..15, then 16..31 of each block
    if kind == "Q4_0":
        return ((u - 8) * parts["d"].unsqueeze(2)).flatten(1)
    return (u * parts["d"].unsqueeze(2) + parts["m"].unsqueeze(2)).flatten(1)
