"""Stage 2 of distillation: train a feature head on the generated shards, with checkpoints, resume
and a wall-clock budget. Loss: the target's own distribution over the draft vocabulary against the
head's (as KL, so 0 is a perfect imitation), plus a feature regression, at every unrolled
drafting step. Held-out accuracy: the head's pick against the target's over its whole vocabulary
(what a verifier accepts), so a token outside the draft vocabulary counts as the miss it is."""

from __future__ import annotations

import json
import math
import random
import time
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specsplit.distill.gen import features_path, save_features, save_whole, shard_paths
from specsplit.model.featurehead import FeatureHead, HeadConfig, unrolled_forward
from specsplit.model.headfile import target_layer


@dataclass(frozen=True)
class TrainSettings:
    budget_s: float
    max_steps: int = 0  # 0: only the time budget bounds training
    draft_vocab: int = 8192
    intermediate: int = 0  # the head's MLP width (0: the target's; HeadConfig.from_target)
    levels: int = 3
    lr: float = 6e-4
    batch_tokens: int = 1024
    reg_weight: float = 0.2
    held_out_every: int = 25  # one sequence in n is kept for evaluation (by a hash of its prompt)
    data_fraction: float = 1.0  # train on this leading share of the training sequences (data-size curves)
    checkpoint_every_s: float = 120.0
    seed: int = 0
    precision: str = "float32"  # of the training matmuls (train_precision); weights and optimizer stay fp32


def train_precision(choice: str) -> str:
    """`auto`: bfloat16 matmuls where the CPU multiplies bf16 natively (AVX-512 BF16, AMX, Arm BF16),
    since training a head is matmul-bound (measured on an EPYC Zen 5: 1,730 against 630 scored tokens
    a second); float32 elsewhere, where bf16 would be widened in software and lose."""
    from specsplit.model.native import cpu_flags

    if choice == "auto":
        return "bfloat16" if cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"} else "float32"
    if choice not in ("float32", "bfloat16"):
        raise ValueError(f"unknown training precision {choice!r}: auto, float32 or bfloat16")
    return choice


def load_examples(data_dir: Path, target=None, log=print) -> list[dict]:
    """Every shard's examples with their features: from the features cache (gen.features_path),
    else from `target` by one prefill per sequence (the features of every position but the last),
    which are then cached, shard by shard, so a stopped run loses little and the next one pays none."""
    examples, started, computed = [], time.monotonic(), 0
    paths = shard_paths(data_dir)
    bar = None
    for path in paths:
        shard = torch.load(path, weights_only=True)
        cached = features_path(path)
        # mapped: file-backed pages the kernel may drop and read again, not anonymous memory (two runs
        # on the default target's 4.58M tokens, 11 GiB each, were killed for memory on a 24 GiB machine)
        feats = torch.load(cached, weights_only=True, mmap=True) if cached.is_file() else None
        if feats is None or [len(f) for f in feats] != [len(ex["ids"]) - 1 for ex in shard]:
            if target is None:
                raise ValueError(f"{path} has no features cached and no target was given to compute them")
            bar = bar or tqdm(total=len(paths), desc="features", unit="shard", mininterval=5)
            feats = features(target, shard)
            save_features(path, feats)
            computed += sum(len(f) for f in feats)
        for ex, f in zip(shard, feats):
            ex["features"] = f
        examples += shard
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
        log(f"features: {computed} positions computed in {time.monotonic() - started:.0f} s (cached)")
    return examples


@torch.inference_mode()
def features(target, examples: list[dict]) -> list[torch.Tensor]:
    from specsplit.model.modeling import KVSequence

    return [KVSequence(target).hidden(ex["ids"][:-1].tolist()).detach().cpu().to(torch.bfloat16)
            for ex in examples]


def build_vocab(examples: list[dict], size: int, eos_ids: list[int], vocab_size: int) -> torch.Tensor:
    """Frequency-ranked draft vocabulary over the target's continuations (FR-Spec); EOS always in,
    then prompt tokens, then the lowest ids fill any remaining room."""
    counts = Counter()
    for ex in examples:
        counts.update(ex["ids"][ex["prompt_len"]:].tolist())
    ranked = [t for t in eos_ids] + [t for t, _ in counts.most_common()]
    prompt_counts = Counter()
    for ex in examples:
        prompt_counts.update(ex["ids"][:ex["prompt_len"]].tolist())
    ranked += [t for t, _ in prompt_counts.most_common()]
    chosen = list(dict.fromkeys(ranked))[:size]
    if len(chosen) < size:
        have = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in have][:size - len(chosen)]
    return torch.tensor(chosen, dtype=torch.long)


def _batches(examples: list[dict], batch_tokens: int, rng: random.Random) -> list[list[dict]]:
    order = sorted(examples, key=lambda ex: len(ex["ids"]))
    batches, current, width = [], [], 0
    for ex in order:
        width = max(width, len(ex["ids"]))
        if current and width * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, width = [], len(ex["ids"])
        current.append(ex)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def _collate(batch: list[dict]):
    """features [B, T, d] (f_0..f_{T-1}), tokens [B, T] (t_1..t_T), loss mask [B, T]: positions i
    whose prediction of f_{i+1} (token t_{i+2}) lies in the continuation."""
    t = max(len(ex["ids"]) for ex in batch) - 1
    d = batch[0]["features"].shape[1]
    feats = torch.zeros(len(batch), t, d)
    tokens = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t, dtype=torch.bool)
    for row, ex in enumerate(batch):
        n = len(ex["ids"]) - 1
        feats[row, :n] = ex["features"].float()
        tokens[row, :n] = ex["ids"][1:].long()
        mask[row, max(ex["prompt_len"] - 2, 0):n - 1] = True
    return feats, tokens, mask


def target_choice(features: torch.Tensor, lm_head: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """The target's greedy token after each feature row: argmax over its whole vocabulary, a few rows
    at a time (a 150k vocabulary's logits for a whole batch would be gigabytes)."""
    return torch.cat([(chunk @ lm_head.T).argmax(-1) for chunk in features.split(rows)])


def _losses(head: FeatureHead, feats, tokens, mask, levels: int, reg_weight: float,
            lm_head: torch.Tensor | None = None):
    """(loss, per-step accuracies). Accuracy: the head's pick equal to the target's over its whole
    vocabulary when lm_head is given (evaluation), else over the draft vocabulary (the cheap view a
    training step prints)."""
    target_feats = feats[:, 1:][mask[:, :-1]]  # f_{i+1} at the masked positions
    with torch.no_grad(), torch.autocast("cpu", enabled=False):  # the target's own sums, exact
        teacher_logp = F.log_softmax(head.logits(target_feats), dim=-1)
        teacher = teacher_logp.exp()
        teacher_top = (target_choice(target_feats, lm_head) if lm_head is not None
                       else head.vocab_ids[teacher.argmax(-1)])
    outs = unrolled_forward(head, feats, tokens, levels)
    total, accs = 0.0, []
    for s, out in enumerate(outs, 1):
        level_mask = mask.clone()
        level_mask[:, :s - 1] = False
        pred = out[:, :-1][mask[:, :-1]]
        keep = level_mask[:, :-1][mask[:, :-1]]
        logp = F.log_softmax(head.logits(pred[keep]).float(), dim=-1)  # (bf16 matmuls: the sums in fp32)
        kl = (teacher[keep] * (teacher_logp[keep] - logp)).sum(-1).mean()  # KL(target || head)
        reg = F.smooth_l1_loss(pred[keep].float(), target_feats[keep])
        total = total + (1.0 - 0.2 * (s - 1)) * (kl + reg_weight * reg)
        accs.append(float((head.vocab_ids[logp.argmax(-1)] == teacher_top[keep]).float().mean()))
    return total, accs


def _hits(student, examples: list[dict], settings: TrainSettings) -> tuple[list[float], int]:
    """Per drafting step, the positions whose top guess is the target's, and the positions scored."""
    hits: list[float] = []
    n = 0
    with torch.no_grad():
        for batch in _batches(examples, settings.batch_tokens, random.Random(0)):
            _, accs, weight = student.losses(batch, exact=True)
            hits = [h + a * weight for h, a in zip(hits or [0.0] * len(accs), accs)]
            n += weight
    return hits, n


def evaluate(student, examples: list[dict], settings: TrainSettings) -> tuple[list[float], dict[str, dict]]:
    """Per drafting step, how often the student's top guess is the target's over its whole vocabulary
    (teacher-forced prefix):
    over all `examples`, and per task type ({type: {"sequences", "step_accuracy"}}: the card's
    per-category view, since a head can be good on code and poor on chat and the mean hides which).
    One pass: the overall figure is the types' positions summed."""
    kinds: dict[str, list[dict]] = {}
    for ex in examples:
        kinds.setdefault(ex.get("task_type") or "unlabelled", []).append(ex)
    total: list[float] = []
    n, by_type = 0, {}
    for kind, exs in sorted(kinds.items()):
        hits, weight = _hits(student, exs, settings)
        by_type[kind] = {"sequences": len(exs), "step_accuracy": [round(h / max(weight, 1), 4) for h in hits]}
        total = [a + b for a, b in zip(total or [0.0] * len(hits), hits)]
        n += weight
    return [h / max(n, 1) for h in total], by_type


def split(examples: list[dict], settings: TrainSettings) -> tuple[list[dict], list[dict]]:
    """(training, held-out). A sequence is held out by a hash of its prompt, so the held-out set stays
    the same as the data grows and a prompt generated twice never sits on both sides; the training
    set is the leading settings.data_fraction of the rest, in the order the data was generated."""
    train_set, held = [], []
    for ex in examples:
        key = zlib.crc32(ex["ids"][:ex["prompt_len"]].numpy().tobytes())
        (held if key % settings.held_out_every == 0 else train_set).append(ex)
    return train_set[:max(1, round(len(train_set) * settings.data_fraction))], held


def expected_acceptance(step_acc: list[float], gamma: int = 4) -> float:
    """Acceptance length (bonus included) if step k's hit rate, given the earlier ones hit, is
    step_acc[min(k, last)]: 1 + sum over k of the chance that the first k drafts all hit."""
    total, run = 1.0, 1.0
    for k in range(gamma):
        run *= step_acc[min(k, len(step_acc) - 1)]
        total += run
    return total


class HeadStudent:
    """The self-draft head: trained on features, unrolled over `levels` drafting steps."""

    def __init__(self, target, embed: torch.Tensor, lm_head: torch.Tensor, vocab: torch.Tensor | None,
                 settings: TrainSettings):
        self.settings = settings
        self.module = FeatureHead(HeadConfig.from_target(target.model.config, settings.draft_vocab,
                                                         settings.intermediate))
        if vocab is not None:  # fresh (else the checkpoint restores weights and vocab): from the last layer
            config = target.model.config  # (its directory: the model's own name_or_path)
            self.module.init_from_target_layer(target_layer(Path(config.name_or_path), config.num_hidden_layers - 1))
        self._wiring = (embed.float(), lm_head.float())
        self.vocab = vocab  # the draft vocabulary ready() gives the head (None: the one it holds)

    def ready(self) -> None:
        embed, lm_head = self._wiring
        self.module.attach(embed, lm_head, self.vocab)

    def losses(self, batch: list[dict], exact: bool = False):
        """(loss, per-step accuracies, positions scored); exact: accuracy against the target's pick
        over its whole vocabulary (see _losses)."""
        feats, tokens, mask = _collate(batch)
        loss, accs = _losses(self.module, feats, tokens, mask, self.settings.levels, self.settings.reg_weight,
                             self._wiring[1] if exact else None)
        return loss, accs, int(mask.sum())


def fit(student, examples: list[dict], out_dir: Path, settings: TrainSettings, log=print,
        origin: dict | None = None) -> dict:
    """The training loop shared by the students: AdamW, cosine schedule over the budget, a
    checkpoint every settings.checkpoint_every_s, resume from out_dir/checkpoint.pt. origin: what a
    fresh run started from (kept in the checkpoint, so a resumed run still says it; returned)."""
    torch.manual_seed(settings.seed)
    train_set, held = split(examples, settings)
    module = student.module
    ckpt_path = out_dir / "checkpoint.pt"
    state = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    elapsed, step, epoch = 0.0, 0, 0
    if state is not None:
        module.load_state_dict(state["weights"])
        elapsed, step, epoch = state["elapsed"], state["step"], state["epoch"]
        origin = state.get("origin", origin)  # (a checkpoint from before origins were kept: as given)
        log(f"resuming at step {step}, {elapsed / 60:.1f} min trained")
    student.ready()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    rng = random.Random(settings.seed + epoch)
    tokens_per_epoch = sum(len(ex["ids"]) - ex["prompt_len"] for ex in train_set)
    log(f"{len(train_set)} training / {len(held)} held-out sequences, {tokens_per_epoch} continuation "
        f"tokens per pass, draft vocab {settings.draft_vocab}")

    def save() -> None:
        save_whole({"weights": module.state_dict(), "optimizer": opt.state_dict(), "elapsed": elapsed,
                    "step": step, "epoch": epoch, "origin": origin}, ckpt_path)

    def done() -> bool:
        return elapsed >= settings.budget_s or 0 < settings.max_steps <= step

    losses: list[float] = []
    bar = tqdm(total=round(settings.budget_s), initial=min(round(elapsed), round(settings.budget_s)),
               desc="train", unit="s")
    last_save = time.monotonic()
    while not done():
        for batch in _batches(train_set, settings.batch_tokens, rng):
            if done():
                break
            t0 = time.monotonic()
            loss, accs = _step(student, opt, params, batch, settings, step, elapsed)
            step += 1
            losses.append(loss)
            elapsed += time.monotonic() - t0
            bar.update(min(round(elapsed), round(settings.budget_s)) - bar.n)
            bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.3f}", acc="/".join(f"{a:.2f}" for a in accs))
            if time.monotonic() - last_save > settings.checkpoint_every_s:
                save()
                last_save = time.monotonic()
        else:
            epoch += 1
            rng = random.Random(settings.seed + epoch)
    bar.close()
    save()
    metrics = {**held_out_metrics(student, held, settings), "steps": step, "epochs": epoch,
               "train_minutes": round(elapsed / 60, 1), "train_sequences": len(train_set),
               "continuation_tokens": tokens_per_epoch}
    log(json.dumps(metrics))
    return {"module": module, "metrics": metrics, "losses": losses, "origin": origin}


def held_out_metrics(student, held: list[dict], settings: TrainSettings) -> dict:
    """The card's held-out figures: accuracy per drafting step, overall and per task type, and the
    acceptance length they imply."""
    step_acc, by_type = evaluate(student, held, settings)
    return {"held_out_step_accuracy": [round(a, 4) for a in step_acc], "held_out_by_task_type": by_type,
            "estimated_acceptance_length_gamma4": round(expected_acceptance(step_acc), 3)}


def _step(student, opt, params: list, batch: list[dict], settings: TrainSettings, step: int,
          elapsed: float) -> tuple[float, list[float]]:
    """One optimizer step: the learning rate on its cosine schedule over the budget (or the step
    bound) after a short warm-up, the loss (bf16 matmuls where settings say), a clipped update.
    Returns (loss, per-step accuracies)."""
    frac = elapsed / settings.budget_s
    if settings.max_steps:
        frac = max(frac, step / settings.max_steps)
    for group in opt.param_groups:
        group["lr"] = settings.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.precision == "bfloat16"):
        loss, accs, _ = student.losses(batch)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return float(loss.detach()), accs


def load_head(target, embed: torch.Tensor, lm_head: torch.Tensor, head_dir: Path,
              settings: TrainSettings) -> HeadStudent:
    """An exported head (head.json + head.safetensors) as a student, ready to evaluate or train on."""
    from safetensors.torch import load_file

    card = json.loads((Path(head_dir) / "head.json").read_text())
    student = HeadStudent(target, embed, lm_head, None, replace(settings, draft_vocab=card["config"]["draft_vocab"],
                                                                intermediate=card["config"]["intermediate"]))
    student.module.load_state_dict({k: v.float() if v.is_floating_point() else v
                                    for k, v in load_file(str(Path(head_dir) / "head.safetensors")).items()})
    return student


def compare(target, embed: torch.Tensor, lm_head: torch.Tensor, examples: list[dict], heads: list[Path],
            settings: TrainSettings) -> list[dict]:
    """Each head's held_out_metrics (the card's keys) on the held-out split of `examples`: heads trained
    on this data (or on less of it, with the same split) never saw these prompts."""
    held = split(examples, settings)[1]
    rows = []
    for head in heads:
        student = load_head(target, embed, lm_head, head, settings)
        student.ready()
        rows.append({"head": str(head), "sequences": len(held), **held_out_metrics(student, held, student.settings)})
    return rows


INIT_CAVEAT = ("this split cannot tell which sequences the starting head trained on, so this head's held-out "
               "accuracy may count some it saw: compare heads on data neither saw")


def train(target, embed: torch.Tensor, lm_head: torch.Tensor, examples: list[dict], out_dir: Path,
          settings: TrainSettings, log=print, init: str | Path | None = None) -> dict:
    """Trains (or resumes) a self-draft head on `examples` (from load_examples) from the target's
    embedding and output head (the very tensors the drafter reads when serving); returns the head
    and its metrics. init: a fresh run starts from this exported head (its weights and draft
    vocabulary size) instead of the target's last layer, to continue it on more data. A fresh run ranks
    its draft vocabulary on its own training sequences: a continued head's output rows are the target's,
    so the ones its first, smaller data ranked carry nothing to keep (docs/drafters.md, train)."""
    if not examples:
        raise RuntimeError("no generated data: run the generate stage first")
    fresh = not (out_dir / "checkpoint.pt").exists()
    seen = split(examples, settings)[0]  # the vocabulary comes from the training sequences only
    if init is not None:  # its shape (a resumed run's weights then come from the checkpoint)
        card = json.loads((Path(init) / "head.json").read_text())
        student = load_head(target, embed, lm_head, Path(init), settings)
        if fresh:
            log(f"starting from head {init} ({card.get('metrics', {}).get('steps', '?')} steps)")
            student.vocab = build_vocab(seen, student.settings.draft_vocab, target.eos_token_ids, target.vocab_size)
        origin = {"head": Path(init).name, "held_out_caveat": INIT_CAVEAT,
                  **{k: card.get("metrics", {}).get(k) for k in ("steps", "train_sequences", "held_out_step_accuracy")}}
        result = fit(student, examples, out_dir, student.settings, log, origin)
        return {"head": result["module"], **result}
    vocab = build_vocab(seen, settings.draft_vocab, target.eos_token_ids, target.vocab_size) if fresh else None
    result = fit(HeadStudent(target, embed, lm_head, vocab, settings), examples, out_dir, settings, log)
    return {"head": result["module"], **result}
