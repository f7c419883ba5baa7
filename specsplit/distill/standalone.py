"""A standalone draft model (`specsplit distill --kind model`): a few of the target's own layers,
its embedding and final norm, trained on the target's continuations to match the target's
distribution over the draft vocabulary. Exported as an ordinary HF directory (plus
`draft_vocab.json`, which lets the model drafter score only those rows of its output head)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from specsplit.distill.train import TrainSettings, build_vocab, fit, split, target_choice

DRAFT_VOCAB_FILE = "draft_vocab.json"


def layer_subset(total: int, keep: int) -> list[int]:
    """`keep` evenly spaced layer indices, first and last included."""
    if keep >= total:
        return list(range(total))
    if keep == 1:
        return [total - 1]
    return sorted({round(j * (total - 1) / (keep - 1)) for j in range(keep)})


class ModelStudent:
    def __init__(self, target, vocab: torch.Tensor, layers: int, settings: TrainSettings):
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(target.model.config)
        keep = layer_subset(config.num_hidden_layers, layers)
        config.num_hidden_layers = len(keep)
        student = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        source = target.model.state_dict()
        own = {}
        for name in student.state_dict():
            parts = name.split(".")
            if "layers" in parts:  # map student layer j to target layer keep[j]
                i = parts.index("layers") + 1
                parts[i] = str(keep[int(parts[i])])
            own[name] = source[".".join(parts)].float()
        student.load_state_dict(own)
        student.get_input_embeddings().weight.requires_grad_(False)  # shared with the target, frozen
        student.get_output_embeddings().weight.requires_grad_(False)
        self.module = student
        self.keep = keep
        self.vocab = vocab
        self.settings = settings
        self._full = target.model.get_output_embeddings().weight.detach().float()  # the target's choice
        self._rows = self._full[vocab]  # teacher rows

    def ready(self) -> None:
        self.module.train()

    def _collate(self, batch: list[dict]):
        t = max(len(ex["ids"]) for ex in batch) - 1
        ids = torch.zeros(len(batch), t, dtype=torch.long)
        feats = torch.zeros(len(batch), t, batch[0]["features"].shape[1])
        mask = torch.zeros(len(batch), t, dtype=torch.bool)
        for row, ex in enumerate(batch):
            n = len(ex["ids"]) - 1
            ids[row, :n] = ex["ids"][:-1].long()
            feats[row, :n] = ex["features"].float()
            mask[row, max(ex["prompt_len"] - 1, 0):n] = True  # positions predicting continuation tokens
        return ids, feats, mask

    def losses(self, batch: list[dict], exact: bool = False):
        """(loss, [accuracy], positions scored); exact: accuracy against the target's pick over its
        whole vocabulary, else over the draft vocabulary."""
        ids, feats, mask = self._collate(batch)
        base = getattr(self.module, self.module.base_model_prefix)
        hidden = base(input_ids=ids).last_hidden_state[mask]  # right padding: causal attention ignores it
        rows = self.module.get_output_embeddings().weight[self.vocab]
        logp = F.log_softmax((hidden @ rows.T).float(), dim=-1)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            teacher_logp = F.log_softmax(feats[mask] @ self._rows.T, dim=-1)
            top = target_choice(feats[mask], self._full) if exact else self.vocab[teacher_logp.argmax(-1)]
        kl = (teacher_logp.exp() * (teacher_logp - logp)).sum(-1).mean()
        acc = float((self.vocab[logp.argmax(-1)] == top).float().mean())
        return kl, [acc], int(mask.sum())


def train_standalone(target, examples: list[dict], out_dir: Path, layers: int, settings: TrainSettings,
                     log=print) -> dict:
    """Trains (or resumes) a standalone draft of `layers` target layers on `examples` (from load_examples)."""
    if not examples:
        raise RuntimeError("no generated data: run the generate stage first")
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_path = out_dir / DRAFT_VOCAB_FILE
    if vocab_path.exists():  # resuming: the vocabulary must not change under the checkpoint
        vocab = torch.tensor(json.loads(vocab_path.read_text()), dtype=torch.long)
    else:
        vocab = build_vocab(split(examples, settings)[0], settings.draft_vocab, target.eos_token_ids, target.vocab_size)
        vocab_path.write_text(json.dumps(vocab.tolist()))
    student = ModelStudent(target, vocab, layers, settings)
    result = fit(student, examples, out_dir, settings, log)
    result["layers"] = student.keep
    return result


def export_standalone(module, target_dir: Path, out_dir: Path, model_dir: Path, card: dict) -> None:
    """An HF directory the model drafter loads with --draft-model, plus its draft vocabulary."""
    model_dir.mkdir(parents=True, exist_ok=True)
    module.eval()
    module.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json"):
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, model_dir / name)
    shutil.copy(out_dir / DRAFT_VOCAB_FILE, model_dir / DRAFT_VOCAB_FILE)
    (model_dir / "draft.json").write_text(json.dumps(card, indent=1) + "\n")

