"""A feature head on disk (`specsplit distill` writes one: head.json, its card, and
head.safetensors) and loading it for the target it was trained for; the serving runner that fits
this machine (native kernels, else torch). torch and the head's code are imported by the
functions that load or run a head: the gateway reads the settings here and never loads torch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from specsplit.errors import UsageError
from specsplit.model.catalog import DEFAULT

if TYPE_CHECKING:
    import torch

    from specsplit.model.featurehead import FeatureHead

HEAD_FORMAT = "specsplit-feature-head/1"
PACKAGED = Path(__file__).resolve().parent / "drafts"


def shipped_head(target_model: str) -> Path:
    """Where the head shipped for a catalog target lives (specsplit/model/drafts/<name>-self; the
    embedded default's name is its model's), whether or not one is there. A target given as its
    directory is named by it (the catalog's cache keeps each model under its name)."""
    name = "smollm2-135m-instruct" if target_model == DEFAULT else Path(target_model).name.lower()
    return PACKAGED / f"{name}-self"


def resolve_head(path: str, target_model: str = DEFAULT) -> Path:
    """A head directory, or `default` for the one shipped for `target_model` (a catalog name; the
    embedded default's unless said)."""
    if path == "default":
        shipped = shipped_head(target_model)
        if not (shipped / "head.json").is_file():
            raise UsageError(f"no head is shipped for target {target_model}: give a head directory, not `default`")
        return shipped
    return Path(path).expanduser()


def head_setting(flag: str, target_model: str) -> str | None:
    """The --self-head flag as the settings take it: 'none' none; 'auto' the head shipped for the
    target if it is a catalog name with one (the embedded default's, the real pair's target's);
    else the flag (a directory)."""
    if flag == "none":
        return None
    if flag == "auto":
        shipped = shipped_head(target_model)
        return str(shipped) if (shipped / "head.json").is_file() else None
    return flag


def read_head_card(head_dir: Path) -> dict:
    card_path = head_dir / "head.json"
    if not card_path.is_file():
        raise FileNotFoundError(f"{head_dir} is not a feature head (no head.json); make one with `specsplit distill`")
    card = json.loads(card_path.read_text())
    if card.get("format") != HEAD_FORMAT:
        raise ValueError(f"{card_path}: format {card.get('format')!r}, expected {HEAD_FORMAT!r}")
    return card


def _read(target_dir: Path, wanted) -> dict[str, torch.Tensor]:
    """The tensors of the target's safetensors files whose names `wanted(name)` accepts, read alone."""
    from safetensors import safe_open

    found = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            found.update({name: st.get_tensor(name) for name in st.keys() if wanted(name)})
    return found


def target_tensors(target_dir: Path, tied: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and output head, read alone from its safetensors files."""
    found = _read(target_dir, lambda name: name.endswith("embed_tokens.weight") or name == "lm_head.weight")
    head = found.pop("lm_head.weight", None)
    embed = next(iter(found.values()), None)
    if embed is None:
        raise ValueError(f"{target_dir}: no '*embed_tokens.weight' tensor in its safetensors files")
    if head is None:
        if not tied:
            raise ValueError(f"{target_dir}: no 'lm_head.weight' tensor and the embeddings are not tied")
        head = embed
    return embed, head


def target_layer(target_dir: Path, index: int) -> dict[str, torch.Tensor]:
    """Decoder layer `index`'s weights by their names inside the layer (`self_attn.q_proj.weight`, ...),
    read alone from the target's safetensors files (a target served from its GGUF blocks holds no
    unpacked copy of them)."""
    prefix = f"model.layers.{index}."
    found = {name[len(prefix):]: t for name, t in _read(target_dir, lambda name: name.startswith(prefix)).items()}
    if not found:
        raise ValueError(f"{target_dir}: no '{prefix}*' tensors in its safetensors files")
    return found


def load_head(head_dir: Path, target_dir: Path, device: str = "cpu", vocab: int = 0) -> tuple[FeatureHead, dict]:
    """The head (float32, the target's embedding and output rows attached) and its card; refused,
    saying so, when it was trained for other target weights. vocab > 0: only the first `vocab`
    rows of its draft vocabulary (the most frequent tokens; fewer bytes a step)."""
    import torch

    from specsplit.model.featurehead import FeatureHead, HeadConfig
    from specsplit.model.identity import weights_fingerprint

    card = read_head_card(head_dir)
    theirs = card["target"]["model_fingerprint"]
    ours = weights_fingerprint(target_dir)
    if theirs != ours:
        raise ValueError(f"feature head {head_dir} was trained for target {card['target']['model_id']} "
                         f"(weights {theirs}); {target_dir} has weights {ours or '(no safetensors)'}: "
                         "retrain it with `specsplit distill` for this target")
    from safetensors.torch import load_file

    # float32 explicitly: the default dtype is process-wide, and a model loading in another
    # thread (transformers switches it while it builds) must not decide this head's dtype.
    head = FeatureHead(HeadConfig(**card["config"])).float()
    head.load_state_dict({k: v.float() for k, v in load_file(str(head_dir / "head.safetensors")).items()})
    embed, lm_head = target_tensors(target_dir, card.get("tied_embeddings", True))
    if 0 < vocab < head.cfg.draft_vocab:  # its most frequent rows: the vocabulary is frequency-ranked
        head.vocab_ids = head.vocab_ids[:vocab].clone()
        head.cfg = dataclasses.replace(head.cfg, draft_vocab=vocab)
    head.attach(embed.to(torch.bfloat16), lm_head.float())
    head.to(device).eval().requires_grad_(False)
    return head, card


# The feature head's weights on the kernels: a step reads all of them (≈ 6.5 M values for the default's
# head at 4,096 rows) and a round's first step reads them back into caches the target's forward
# flushed, so the fewer bytes the better while the drafts stay as good. q4_0 on every path: on AVX2
# (and NEON) q8's signs cost two more instructions a quad without VNNI (a step 0.15 ms against q8_0's
# 0.25 on an EPYC, acceptance unchanged); on AVX-512 VNNI a drafted token cost 0.104-0.105 of a
# target step against q8_0's 0.137-0.140 (forced self, `specsplit bench --drafters self,default`,
# four runs alternating, EPYC Zen 5), acceptance length 1.49-1.59 against 1.47-1.56.
HEAD_WEIGHTS = "q4_0"


def head_runner(head: FeatureHead, device: torch.device, max_positions: int):
    """The native kernels when they run here, else torch. Weights in HEAD_WEIGHTS where the block
    formats run, else bfloat16 where the CPU has bf16 dot products (half the bytes of float32).
    Drafts need not match any other path, only be the same for a session however it is batched."""
    import torch

    from specsplit.model import native
    from specsplit.model.headserving import NativeHead, TorchHead

    if native.unavailable(torch.float32, device) is None and head.cfg.head_dim % 16 == 0:
        dtype = torch.bfloat16 if native.unavailable(torch.bfloat16, device) is None else torch.float32
        quantize = HEAD_WEIGHTS if native.lacks_vnni() is None else ""
        try:
            return NativeHead(head, max_positions, dtype, quantize)
        except (RuntimeError, OSError):  # no compiler, a failed build: torch still drafts
            pass
    return TorchHead(head)


def max_context(target_dir: Path) -> int:
    """The positions a head's cache may need: the target's context."""
    return int(json.loads((target_dir / "config.json").read_text()).get("max_position_embeddings") or 8192)
