"""Which weights a target is served from when the user does not say (`--quantize auto`, the default).

A model that comes as a GGUF file (every catalog model: its directory holds model.gguf) is served
from the file's own blocks, as llama.cpp and Ollama serve it: its float weights are that file
dequantized, so they cost 2-2.5x the time for no gain in fidelity to the file. Unless the blocks are
worse: their perplexity on a fixed text (specsplit/data/perplexity.txt) against the dequantized
weights', in the dtype asked. The blocks are refused when that text shows them more than 1 % worse
beyond its own uncertainty: the mean per-token log-likelihood difference less two standard errors
(about 460 tokens; on the default model two standard errors are 1.4 %) must exceed log(1.01). A
difference within the text's noise, or between machines' kernels (the default model measures
+0.96 % to +1.1 % on machines of this kind), does not flip the choice.

The verdict is measured once per file, dtype and kernel path, and kept in the cache
(`<cache>/weights/`), so a verifier that starts later, or `specsplit models`, reads it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger("specsplit")

UNMEASURED = "its GGUF file's own blocks unless their perplexity is more than 1 % worse (measured at its first start)"
WORSE = 0.01  # the blocks are refused when their perplexity is more than this much worse
SIGMAS = 2.0  # ... beyond this many standard errors of the text's per-token differences


@dataclass(frozen=True)
class Choice:
    quantize: str  # what load_model takes: "gguf", or "" (the dtype asked)
    why: str


@dataclass(frozen=True)
class Measured:
    float_ppl: float
    gguf_ppl: float
    low: float  # the ratio's lower bound: exp(mean difference - SIGMAS standard errors)
    tokens: int

    @property
    def ratio(self) -> float:
        return self.gguf_ppl / self.float_ppl

    def choice(self, dtype: str) -> Choice:
        figures = (f"perplexity {self.gguf_ppl:.2f} from the blocks vs {self.float_ppl:.2f} {dtype}, "
                   f"{100 * (self.ratio - 1):+.2f} % (at least {100 * (self.low - 1):+.2f} %) on "
                   f"{self.tokens} tokens")
        if self.low > 1 + WORSE:
            return Choice("", f"its GGUF blocks are more than {WORSE:.0%} worse: {figures}")
        return Choice("gguf", f"its GGUF file's own blocks: {figures}")


def resolve(quantize: str, model: str, dtype: str = "bfloat16", device: str = "cpu") -> str:
    """The --quantize flag as load_model takes it: "auto" chosen (and logged with why), else as given."""
    if quantize != "auto":
        return quantize
    from specsplit.model import catalog

    choice = choose(catalog.resolve(model), dtype, device)
    log.info("weights of %s: %s", model, choice.why)
    return choice.quantize


def choose(model_dir: Path, dtype: str = "bfloat16", device: str = "cpu") -> Choice:
    """`--quantize auto` for the model in model_dir: measured once (a few seconds on the default
    model, about a minute on a 1.5B) and cached."""
    from specsplit.model import native

    if not (model_dir / "model.gguf").exists():
        return Choice("", f"{dtype}: no model.gguf (not a GGUF-sourced model)")
    why_not = native.unavailable(torch.float32, torch.device(device)) or native.lacks_vnni()
    if why_not:
        return Choice("", f"{dtype}: its GGUF blocks need the native kernels with AVX-512 VNNI ({why_not})")
    path = _record_path(model_dir, dtype)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process measures; the others read its verdict
            if not path.is_file():
                log.info("choosing %s's weights: perplexity of its GGUF blocks vs %s (once)", model_dir.name, dtype)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(asdict(measure(model_dir, dtype))))
                tmp.replace(path)
    return _verdict(path, dtype)


def recorded(model_dir: Path, dtype: str = "bfloat16") -> Choice | None:
    """The verdict measured earlier on this machine, if any (for `specsplit models`)."""
    if not (model_dir / "model.gguf").exists():
        return None
    path = _record_path(model_dir, dtype)
    return _verdict(path, dtype) if path.is_file() else None


def _verdict(path: Path, dtype: str) -> Choice:
    return Measured(**json.loads(path.read_text())).choice(dtype)


def measure(model_dir: Path, dtype: str) -> Measured:
    """Per-token negative log-likelihoods of the fixed text under both weights, one model loaded at
    a time; their paired differences give the ratio and its uncertainty."""
    from importlib import resources

    text = resources.files("specsplit.data").joinpath("perplexity.txt").read_text()
    nll = {}
    for quantize in ("", "gguf"):
        nll[quantize] = _token_nll(model_dir, dtype, quantize, text)
    diffs = [g - f for g, f in zip(nll["gguf"], nll[""])]
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
    return Measured(float_ppl=math.exp(statistics.fmean(nll[""])), gguf_ppl=math.exp(statistics.fmean(nll["gguf"])),
                    low=math.exp(mean - SIGMAS * se), tokens=len(diffs))


def _token_nll(model_dir: Path, dtype: str, quantize: str, text: str) -> list[float]:
    from specsplit.model.modeling import KVSequence, load_model

    lm = load_model(model_dir, dtype, quantize=quantize)
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids[:lm.max_context]
    logits = KVSequence(lm).forward(ids).float()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return (-logp.squeeze(1)).tolist()


def _record_path(model_dir: Path, dtype: str) -> Path:
    """Keyed by the file (resolved path, size, mtime), the dtype and the kernels that run both forms
    here (an AMX machine's bf16 path differs from AVX-512's)."""
    from specsplit.model import catalog
    from specsplit.model.fastllama import kernel_name
    from specsplit.model.modeling import parse_dtype

    gguf = (model_dir / "model.gguf").resolve()
    stat = gguf.stat()
    key = "|".join([str(gguf), str(stat.st_size), str(stat.st_mtime_ns), dtype,
                    kernel_name("", parse_dtype(dtype)), kernel_name("gguf", parse_dtype(dtype))])
    return catalog.cache_root() / "weights" / f"{model_dir.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
