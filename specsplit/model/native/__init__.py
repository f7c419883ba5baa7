"""Builds (once per machine, cached) and loads the native decoder kernels in decoder.cpp.

The build needs a C++ compiler and ninja and takes about 30 s; the result is cached under
~/.cache/specsplit/model/native/<digest of source, torch version and flags>, so later starts load it in
well under a second. `unavailable()` says why not when the kernels cannot run here."""

from __future__ import annotations

import hashlib
import os
import threading
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decoder.cpp")  # includes its parts: *.h, attention_*.inc
PARTS = sorted(p for p in SOURCE.parent.iterdir() if p.suffix in {".cpp", ".h", ".inc"})
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma",
         "-fopenmp"]
_LOCK = threading.Lock()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """None if the kernels can run a model of `dtype` on `device` here, else why not."""
    if device.type != "cpu":
        return f"the native kernels are for CPUs, not {device.type}"
    if os.environ.get("SPECSPLIT_NATIVE", "1") == "0":
        return "SPECSPLIT_NATIVE=0"
    flags = cpu_flags()
    need = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} | ({"avx512_bf16"} if dtype == torch.bfloat16 else set())
    missing = sorted(need - flags)
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"the native kernels run bfloat16 or float32, not {dtype}"
    return None


def amx() -> bool:
    """bf16 GEMMs on AMX tiles (tdpbf16ps): where the CPU has them, unless SPECSPLIT_AMX=0 (which
    tests use to check the AVX-512 path on an AMX machine too)."""
    return {"amx_bf16", "amx_tile"} <= cpu_flags() and os.environ.get("SPECSPLIT_AMX", "1") != "0"


def lacks_vnni() -> str | None:
    """None if q8_0 GEMMs (vpdpbusd) can run here, else why not."""
    return None if "avx512_vnni" in cpu_flags() else "this CPU lacks avx512_vnni"


def cache_dir() -> Path:
    root = Path(os.environ.get("SPECSPLIT_CACHE", Path.home() / ".cache" / "specsplit"))
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in PARTS)
                            + torch.__version__.encode() + " ".join(FLAGS).encode())
    return root / "native" / digest.hexdigest()[:12]


@lru_cache(maxsize=1)
def module():
    """The compiled extension: imported from the cache when built before (the cache directory is
    named by the digest of everything that goes into it), else built first. Raises if it cannot be
    built."""
    import importlib.util

    build = cache_dir()
    name = f"specsplit_decoder_{build.name}"
    library = build / f"{name}.so"
    with _LOCK:
        if not library.exists():
            return _build(build, name)
        spec = importlib.util.spec_from_file_location(name, library)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


def _build(build: Path, name: str):
    """Compiles into a private directory, then moves the library into place, so that concurrent
    builds (three services starting at once) never load a half-written file."""
    import tempfile

    from torch.utils.cpp_extension import load

    build.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build) as tmp:
        mod = load(name=name, sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                   build_directory=tmp, verbose=False)
        os.replace(Path(tmp) / f"{name}.so", build / f"{name}.so")
    return mod
