"""What a model and a drafter are, by content: the fingerprints of a tokenizer and of a model's
weights, and the one check that a drafter may draft for a target."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the token→id map and the special tokens: equal fingerprints mean equal ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def pairing_problem(drafter: str, tokenizer: str, trained_for: str, target_tokenizer: str,
                    target_weights: str) -> str:
    """Why a drafter cannot draft for a target, or "" when it can: the one check, made by the
    gateway (at start and per request) and by the draft service (at StartSession). `tokenizer` and
    `trained_for` are the drafter's tokenizer fingerprint and the target weights it was trained on
    ("" when it reads no features); an empty fingerprint is unknown and compares with nothing."""
    if tokenizer and target_tokenizer and tokenizer != target_tokenizer:
        return (f"{drafter} uses tokenizer {tokenizer}, the target uses {target_tokenizer}: "
                "their token ids do not match")
    if trained_for and target_weights and trained_for != target_weights:
        return (f"{drafter} was trained for target weights {trained_for}, the target has {target_weights}: "
                "retrain it with `specsplit distill`")
    return ""


def weights_fingerprint(model_dir: str | Path) -> str:
    """sha256 over every weight tensor's name, shape and 16 evenly spaced rows cast to bfloat16,
    read lazily from the safetensors files (a few ms, even for large models). Equal digests mean
    the same weights for any practical purpose: fine-tuning changes every row of a tensor it
    touches, and the bfloat16 cast makes an fp32 and a bf16 copy of one model agree. "" when the
    directory has no safetensors files."""
    import torch  # here: the gateway checks pairings with the fingerprints alone, and never loads torch
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return ""
    digest = hashlib.sha256()
    handles = [safe_open(str(f), "pt") for f in files]
    names = sorted((name, i) for i, h in enumerate(handles) for name in h.keys())
    for name, i in names:
        tensor_slice = handles[i].get_slice(name)
        shape = list(tensor_slice.get_shape())
        digest.update(json.dumps([name, shape]).encode())
        if not shape:
            sample = handles[i].get_tensor(name).reshape(1)
        else:
            rows = sorted({round(r * (shape[0] - 1) / 15) for r in range(16)})
            sample = torch.stack([tensor_slice[r:r + 1][0] for r in rows])
        digest.update(sample.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]
