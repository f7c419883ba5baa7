"""Builds (once per machine, cached) and loads the native decoder kernels in decoder.cpp.

The build needs a C++ compiler and ninja and takes about 30 s; the result is cached under
~/.cache/specsplit/model/native/<digest of source, torch version and flags>, so later starts load it in
well under a second. `unavailable()` says why not when the kernels cannot run here."""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decoder.cpp")  # includes its parts: *.h
PARTS = sorted(p for p in SOURCE.parent.iterdir() if p.suffix in {".cpp", ".h"})
# The instruction sets the kernels are built for, best first: compiler flags and the CPU flags each
# needs. One library per set (decoder.cpp includes isa_<set>.h); "amx" is the avx512 library with
# bf16 GEMMs and attention on AMX tiles; "neon" (aarch64: the "Features" line's asimd and fphp) is
# the AVX2 path's code on NEON (neon_avx2.h), "neon_dot" the same with the block formats'
# products by sdot (asimddp: Neoverse N1 and later, every Arm server CPU since 2019), and
# "neon_i8mm" with two rows at a time by smmla (i8mm: Neoverse V1/N2 and later, Graviton 3 and 4);
# all checked bit for bit against the x86 build under qemu-user (tests/test_kernelcheck.py), not yet
# timed on Arm hardware.
ISAS = {
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma",
                "-mf16c"], {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
    "neon_i8mm": (["-march=armv8.2-a+dotprod+i8mm"], {"asimd", "fphp", "asimddp", "i8mm"}),
    "neon_dot": (["-march=armv8.2-a+dotprod"], {"asimd", "fphp", "asimddp"}),
    "neon": ([], {"asimd", "fphp"}),
}
PATHS = ("amx", "avx512", "avx2", "neon_i8mm", "neon_dot", "neon")  # what SPECSPLIT_ISA may name, best first
# the paths that run isa_avx2.h: bf16 widened to fp32, blocks by vpmaddubsw (or Arm's sdot, smmla)
AVX2_CODE = ("avx2", "neon_i8mm", "neon_dot", "neon")
_LOCK = threading.Lock()


@lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (read once: a load asked 276 times, 35 ms of /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86, aarch64
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def lacks(path: str) -> str | None:
    """None if this CPU can run kernel path `path`, else what it lacks."""
    flags = cpu_flags()
    need = ISAS["avx512" if path == "amx" else path][1] | ({"amx_bf16", "amx_tile"} if path == "amx" else set())
    missing = sorted(need - flags)
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def runnable() -> list[str]:
    """The kernel paths this CPU can run, best first (tests run each of them)."""
    return [p for p in PATHS if lacks(p) is None]


def isa() -> tuple[str | None, str]:
    """(the kernel path that runs, why): SPECSPLIT_ISA if set, else the best this CPU runs
    (SPECSPLIT_AMX=0 passes over AMX). None where none can run."""
    forced = os.environ.get("SPECSPLIT_ISA", "")
    if forced:
        if forced not in PATHS:
            return None, f"SPECSPLIT_ISA={forced} is not one of {', '.join(PATHS)}"
        why = lacks(forced)
        return (None, f"SPECSPLIT_ISA={forced}, but {why}") if why else (forced, f"SPECSPLIT_ISA={forced}")
    paths = [p for p in runnable() if not (p == "amx" and os.environ.get("SPECSPLIT_AMX", "1") == "0")]
    if not paths:
        return None, lacks("neon" if platform.machine() == "aarch64" else "avx2") or "no kernel path"
    return paths[0], "the best this CPU runs" + (" (SPECSPLIT_AMX=0)" if "amx" in runnable() and paths[0] != "amx"
                                                 else "")


def unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """None if the kernels can run a model of `dtype` on `device` here, else why not."""
    if device.type != "cpu":
        return f"the native kernels are for CPUs, not {device.type}"
    if os.environ.get("SPECSPLIT_NATIVE", "1") == "0":
        return "SPECSPLIT_NATIVE=0"
    path, why = isa()
    if path is None:
        return why
    if dtype not in (torch.bfloat16, torch.float32):
        return f"the native kernels run bfloat16 or float32, not {dtype}"
    if dtype == torch.bfloat16 and path not in AVX2_CODE and "avx512_bf16" not in cpu_flags():
        return "this CPU lacks avx512_bf16 (SPECSPLIT_ISA=avx2 widens bf16 instead)"
    return None


def amx() -> bool:
    """bf16 GEMMs and attention on AMX tiles (tdpbf16ps): the "amx" path."""
    return isa()[0] == "amx"


def lacks_vnni() -> str | None:
    """None if the block formats (q8 rows by q8_0 / q4 / GGUF blocks) can run here, else why not: the
    AVX-512 path multiplies them with vpdpbusd (AVX512_VNNI), the AVX2 path with vpmaddubsw."""
    if isa()[0] in AVX2_CODE:
        return None
    return None if "avx512_vnni" in cpu_flags() else "this CPU lacks avx512_vnni"


def describe() -> str:
    """The kernel path that runs and why, for logs, `validate`, `models` and the bench."""
    path, why = isa()
    if os.environ.get("SPECSPLIT_NATIVE", "1") == "0":
        return "native kernels off (SPECSPLIT_NATIVE=0)"
    return f"{path} ({why})" if path else f"no native kernels: {why}"


def _library(path: str | None = None) -> str:
    """The library a kernel path runs on (amx: the avx512 one)."""
    path = path or isa()[0]
    if path is None:
        raise RuntimeError(isa()[1])
    return "avx512" if path == "amx" else path


def cache_dir(library: str | None = None) -> Path:
    library = library or _library()
    root = Path(os.environ.get("SPECSPLIT_CACHE", Path.home() / ".cache" / "specsplit"))
    flags = ISAS[library][0] + ["-O3", "-fopenmp"]
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in PARTS)
                            + torch.__version__.encode() + " ".join(flags).encode())
    return root / "native" / f"{library}_{digest.hexdigest()[:12]}"


def module():
    """The compiled extension of the kernel path that runs (isa()). Raises if none can run."""
    return _module(_library())


@lru_cache(maxsize=None)
def _module(library: str):
    """The compiled extension for one instruction set: imported from the cache when built before
    (the cache directory is named by the digest of everything that goes into it), else built first.
    Raises if it cannot be built."""
    import importlib.util

    build = cache_dir(library)
    name = f"specsplit_decoder_{build.name}"
    so = build / f"{name}.so"
    with _LOCK:
        if not so.exists():
            return _build(build, name, ISAS[library][0] + ["-O3", "-fopenmp"])
        spec = importlib.util.spec_from_file_location(name, so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


def _build(build: Path, name: str, flags: list[str]):
    """Compiles into a private directory, then moves the library into place, so that concurrent
    builds (three services starting at once) never load a half-written file."""
    import tempfile

    from torch.utils.cpp_extension import load

    build.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build) as tmp:
        mod = load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                   build_directory=tmp, verbose=False)
        os.replace(Path(tmp) / f"{name}.so", build / f"{name}.so")
    return mod
