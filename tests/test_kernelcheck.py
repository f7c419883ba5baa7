"""The kernels on Arm. The AVX2 path's code (isa_avx2.h, attention_avx2.h) built for aarch64, where
it runs on NEON (neon_avx2.h), alone, with sdot and with smmla (the "neon_dot" and "neon_i8mm"
paths), and run under qemu-user gives the x86 build's bits: every weight format the kernels serve
(float32, bf16, int8, q8_0, q4_0, q4_1 with float16 and with factored scales, q8_h, q6_h), 1 to 9
rows, each row alone as in a batch, the row ops (RMS norm, SiLU * up, argmax, sum of exp) and
attention (bf16 and fp32 caches, grouped heads, chains and tree paths).
The x86 build of the same check is held to the maths: its GEMM against torch's float matmul of
the dequantized weights, its attention against torch's softmax attention.

The builds: g++ for x86-64 and aarch64-linux-gnu-g++ (apt: g++-aarch64-linux-gnu), qemu-aarch64
(apt: qemu-user); where either is missing the comparison is skipped and says so."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

NATIVE = Path(__file__).parents[1] / "specsplit" / "model" / "native"
SOURCE = Path(__file__).with_name("kernelcheck.cpp")
KINDS = ("bf16", "f32", "int8", "q8_0", "q4_0", "q4_1", "q8_h", "q6_h")  # panels.h's Kind, in order
F32, BF16, Q8 = 0, 1, 2  # rows.h's Act
ROWS = (1, 5, 9)  # one row, a block of rows (pairs and an odd one), and more than a block (8)
ARM_PATHS = ("neon", "neon_dot", "neon_i8mm")  # the shim alone, with sdot, with smmla

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="compares an aarch64 build against the x86-64 one: runs on x86-64 hosts")


def build(compiler: str, flags: list[str]) -> Path:
    """The check built by `compiler` with `flags`, cached beside the native kernels' own builds
    (named by the digest of its sources and flags: a changed kernel is built anew)."""
    parts = sorted(NATIVE.glob("*.h")) + [SOURCE]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts) + " ".join(flags).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("SPECSPLIT_CACHE", Path.home() / ".cache" / "specsplit")) / "kernelcheck"
    cache.mkdir(parents=True, exist_ok=True)
    exe = cache / f"kernelcheck-{compiler}-{digest}"
    if not exe.exists():
        partial = exe.with_name(f"{exe.name}.{os.getpid()}.partial")
        subprocess.run([compiler, "-O2", "-std=c++17", *flags, "-I", str(NATIVE), str(SOURCE), "-o", str(partial)],
                       check=True, timeout=300)
        os.replace(partial, exe)
    return exe


@pytest.fixture(scope="module")
def builds() -> dict[str, list[str] | None]:
    """The command that runs each build ("x86" and ARM_PATHS), None where this host cannot build or
    run it."""
    from specsplit.model import native

    runs: dict[str, list[str] | None] = {"x86": None, **{path: None for path in ARM_PATHS}}
    if shutil.which("g++") and native.lacks("avx2") is None:
        runs["x86"] = [str(build("g++", ["-mavx2", "-mfma", "-mf16c"]))]
    if shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64"):
        for path in ARM_PATHS:  # each Arm path with the flags it is served with
            exe = build("aarch64-linux-gnu-g++", ["-static", *native.ISAS[path][0]])
            runs[path] = ["qemu-aarch64", "-cpu", "max", str(exe)]
    return runs


def weights(gen: torch.Generator):
    """(label, Weight, act, the float weights it stands for, tolerance of the x86 GEMM against them)."""
    from specsplit.model import native

    W = native.module().Weight

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    def ints(lo, hi, *shape, dtype=torch.int8):
        return torch.randint(lo, hi, shape, generator=gen).to(dtype)

    def half(t):  # exactly float16 values, as GGUF's d and m are
        return t.to(torch.float16).float()

    out = []
    for n, k in ((64, 200), (80, 512)):  # inputs not a whole block; outputs pairing up (SiLU) or not
        w = rand(n, k) * 0.1
        out += [("f32", W.dense(w, 0, False), F32, w, 1e-5),
                ("bf16", W.dense(w.bfloat16(), 0, False), BF16, w, 2e-2),
                ("int8", W.dense(w.bfloat16(), 1, False), BF16, w, 3e-2),
                ("q8_0", W.dense(w, 2, False), Q8, w, 3e-2),
                ("q4_0", W.dense(w, 3, False), Q8, w, 0.2)]
    n, k = 80, 512
    blocks = k // 32
    nibbles = ints(0, 256, n, blocks, 16, dtype=torch.uint8)
    u = torch.cat([nibbles & 15, nibbles >> 4], dim=2).float()  # byte j: input j low, j + 16 high
    d, m = half(rand(n, blocks).abs() * 0.01), half(rand(n, blocks) * 0.05)
    out.append(("q4_1", W.q4_1(nibbles, d, m, k), Q8, (d[..., None] * u + m[..., None]).reshape(n, k), 3e-2))
    # Q4_K's scales and mins: int8 factors of a float16 base per 8 blocks
    d_factor, m_factor = ints(1, 64, n, blocks), ints(-64, 0, n, blocks)
    d_base, m_base = half(rand(n, blocks // 8).abs() * 1e-3), half(rand(n, blocks // 8).abs() * 1e-3)
    rep = lambda base: base.repeat_interleave(8, dim=1)  # noqa: E731
    dq, mq = d_factor.float() * rep(d_base), m_factor.float() * rep(m_base)
    out.append(("q4_1 factored", W.q4_1(nibbles, d_factor, m_factor, k, d_base, m_base), Q8,
                (dq[..., None] * u + mq[..., None]).reshape(n, k), 3e-2))
    for label, lo, hi, narrow in (("q8_h", -127, 128, False), ("q6_h", -32, 32, True)):
        q = ints(lo, hi, n, blocks, 32)
        dh = half(rand(n, blocks, 2).abs() * 0.01)
        mh = half(rand(n, blocks) * 0.05)
        deq = (dh.repeat_interleave(16, dim=2) * q.float() + mh[..., None]).reshape(n, k)
        out.append((label, W.q8_h(q, dh, mh, k, narrow=narrow), Q8, deq, 3e-2))
    q = ints(-32, 32, n, blocks, 32)
    dh_factor = ints(-64, 64, n, blocks, 2)
    deq = ((dh_factor.float() * rep(d_base)[..., None]).repeat_interleave(16, dim=2) * q.float()).reshape(n, k)
    out.append(("q6_h factored", W.q8_h(q, dh_factor, None, k, d_base=d_base), Q8, deq, 3e-2))
    return out


def attention_cases(gen: torch.Generator):
    """(heads, kv_heads, d, bf16, cache [2, cap, kv_heads, d] fp32 values, [(base, path)], q rows
    [n, (heads + 2 kv_heads) d]): a chain after a prefix and a tree's paths (siblings share ancestors)."""
    out = []
    for heads, kv_heads, d, bf16 in ((9, 3, 64, True), (4, 4, 32, False), (6, 2, 48, True)):
        cap = 40
        cache = torch.randn(2, cap, kv_heads, d, generator=gen)
        if bf16:
            cache = cache.bfloat16().float()  # what the cache holds
        rows = [(20, [20]), (20, [20, 21]), (20, [20, 21, 22]),  # a chain of three after 20 keys
                (30, [30, 32]), (30, [31, 33]), (30, [30, 32, 35]), (0, [0])]  # tree paths; a first token
        q = torch.randn(len(rows), (heads + 2 * kv_heads) * d, generator=gen)
        out.append((heads, kv_heads, d, bf16, cache, rows, q))
    return out


def attention_reference(heads, kv_heads, d, cache, rows, q) -> torch.Tensor:
    out = []
    for (base, path), qr in zip(rows, q):
        slots = list(range(base)) + path
        k, v = cache[0, slots], cache[1, slots]  # [keys, kv_heads, d]
        heads_out = []
        for h in range(heads):
            g = h // (heads // kv_heads)
            p = torch.softmax(k[:, g] @ qr[h * d:(h + 1) * d] / d ** 0.5, dim=0)
            heads_out.append(p @ v[:, g])
        out.append(torch.cat(heads_out))
    return torch.stack(out)


def write_cases(path: Path, cases, attention) -> None:
    with path.open("wb") as f:
        f.write(struct.pack("<q", len(cases)))
        for w, act, x in cases:
            bufs = w.buffers()
            kind, meta, n, k, k2 = bufs.pop("sizes").tolist()
            f.write(struct.pack("<7q", kind, meta, n, k, k2, x.shape[0], act))
            f.write(struct.pack("<q", len(bufs)))
            for name, t in bufs.items():
                raw = t.contiguous().view(torch.uint8).numpy().tobytes()
                f.write(struct.pack("<q", len(name)) + name.encode() + struct.pack("<q", len(raw)) + raw)
            f.write(x.numpy().astype("<f4").tobytes())
        f.write(struct.pack("<q", len(attention)))
        for heads, kv_heads, d, bf16, cache, rows, q in attention:
            f.write(struct.pack("<6q", heads, kv_heads, d, int(bf16), len(rows), cache.shape[1]))
            stored = cache.bfloat16().view(torch.int16) if bf16 else cache
            f.write(stored.contiguous().numpy().tobytes())
            for base, slots in rows:
                f.write(struct.pack(f"<{2 + len(slots)}q", base, len(slots), *slots))
            f.write(q.numpy().astype("<f4").tobytes())


def outputs(raw: bytes, cases, attention) -> list[dict[str, np.ndarray]]:
    """Each case's results, split as kernelcheck.cpp writes them (the GEMM cases', then attention's)."""
    v, at, out = np.frombuffer(raw, dtype="<f4"), 0, []
    for w, _, x in cases:
        rows, n, k = x.shape[0], w.outputs, w.inputs
        sizes = {"batch": rows * n, "alone": rows * n, "norm": rows * k}
        if n % 32 == 0:
            sizes["silu"] = rows * n // 2
        sizes["picks"] = 2 * rows
        res = {}
        for name, size in sizes.items():
            res[name] = v[at:at + size]
            at += size
        out.append(res)
    for heads, _, d, _, _, rows, _ in attention:
        res = {}
        for name in ("attention", "attention alone"):
            res[name] = v[at:at + len(rows) * heads * d]
            at += len(rows) * heads * d
        out.append(res)
    assert at == v.size, "kernelcheck wrote another number of values than its cases call for"
    return out


def run(cmd: list[str], cases_file: Path, out: Path) -> bytes:
    subprocess.run([*cmd, str(cases_file), str(out)], check=True, timeout=600)
    return out.read_bytes()


def test_the_aarch64_build_gives_the_x86_builds_bits_and_the_x86_build_the_maths(builds, tmp_path):
    if builds["x86"] is None:
        pytest.skip("no g++ or no AVX2 here: the x86 build of the kernel check cannot run")
    gen = torch.Generator().manual_seed(0)
    labelled = [(label, (w, act, torch.randn(rows, w.inputs, generator=gen)), deq, tol)
                for label, w, act, deq, tol in weights(gen) for rows in ROWS]
    cases = [case for _, case, _, _ in labelled]
    assert {w.kind for w, _, _ in cases} == set(KINDS)  # every format the kernels serve
    attention = attention_cases(gen)
    path = tmp_path / "cases.bin"
    write_cases(path, cases, attention)
    x86 = run(builds["x86"], path, tmp_path / "x86.out")
    results = outputs(x86, cases, attention)
    for (heads, kv_heads, d, _, cache, rows, q), res in zip(attention, results[len(cases):]):
        want = attention_reference(heads, kv_heads, d, cache, rows, q)
        got = torch.from_numpy(res["attention"].copy()).view(len(rows), heads * d)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), f"attention {heads}/{kv_heads}x{d}: not the maths"
        assert np.array_equal(res["attention"], res["attention alone"]), "a row's attention depends on its batch"
    for (label, (w, _, x), deq, tol), res in zip(labelled, results):
        y = torch.from_numpy(res["batch"].copy()).view(x.shape[0], w.outputs)
        ref = x @ deq.T
        err = float((y - ref).norm() / ref.norm())
        assert err < tol, f"{label}, {x.shape[0]} rows: the GEMM is {err:.3g} from the float maths (allowed {tol})"
        assert np.array_equal(res["batch"], res["alone"]), f"{label}: a row's result depends on its batch"
        picks = res["picks"].reshape(-1, 2)
        assert np.array_equal(picks[:, 0], y.argmax(1).numpy().astype(np.float32)), label
        sums = torch.exp(y - y.max(1, keepdim=True).values).sum(1).numpy()
        assert np.allclose(picks[:, 1], sums, rtol=1e-5), label
        normed = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-5) * x[0]
        assert np.allclose(res["norm"], normed.flatten().numpy(), rtol=1e-4, atol=1e-5), label
        if "silu" in res:
            pairs = y.view(x.shape[0], -1, 2, 16)  # gate and up interleaved by 16-output panel
            want = torch.nn.functional.silu(pairs[:, :, 0]) * pairs[:, :, 1]
            assert np.allclose(res["silu"], want.flatten().numpy(), rtol=1e-4, atol=1e-6), label
    if builds["neon"] is None:
        pytest.skip("no aarch64-linux-gnu-g++ or qemu-aarch64 here (apt: g++-aarch64-linux-gnu qemu-user): "
                    "the x86 build was checked, the aarch64 ones not built")
    names = [f"{label}, {x.shape[0]} rows" for label, (_, _, x), _, _ in labelled]
    names += [f"attention {h}/{g}x{d}{' bf16' if b else ''}" for h, g, d, b, *_ in attention]
    for arm_path in ARM_PATHS:
        arm = run(builds[arm_path], path, tmp_path / f"{arm_path}.out")
        for name, a, b in zip(names, results, outputs(arm, cases, attention), strict=True):
            for part in a:
                same = a[part].view(np.uint32) == b[part].view(np.uint32)
                assert same.all(), (f"{name}, {part}: the aarch64 {arm_path} build differs from the x86 build "
                                    f"in {int((~same).sum())} of {same.size} values")
