"""`specsplit distill`: generate (resumable shards) -> train (checkpointed, resumable) -> export, and
eval (heads side by side on the held-out split, per task type).

Each stage has its own budget; rerunning the same command resumes where it stopped, and a larger
--train-minutes continues training from the checkpoint."""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from specsplit.distill import gen
from specsplit.distill.prompts import load_prompts, target_written
from specsplit.distill.standalone import export_standalone, train_standalone
from specsplit.distill.train import TrainSettings, compare, load_examples, train, train_precision
from specsplit.model import catalog, weightchoice
from specsplit.model.featurehead import HeadConfig
from specsplit.model.headfile import HEAD_FORMAT, target_tensors
from specsplit.model.modeling import load_model


@dataclass(frozen=True)
class DistillSettings:
    target_model: str
    out: str
    prompts: str | None = None  # JSONL; None: the built-in set
    gen_minutes: float = 30.0
    train_minutes: float = 30.0
    train_steps: int = 0  # > 0: also stop at this many optimizer steps (equal work per point of a curve)
    max_new_tokens: int = 192
    batch: int = 8
    draft_vocab: int = 8192
    head_intermediate: int = 0  # self: the head's MLP width (0: the target's)
    levels: int = 3
    lr: float = 6e-4
    dtype: str = "bfloat16"  # of the target while generating (the features keep it)
    device: str = "cpu"
    stages: tuple[str, ...] = ("generate", "train", "export")
    batch_tokens: int = 1024
    kind: str = "self"  # self: a feature head; model: a standalone draft model of `layers` target layers
    layers: int = 2
    prompt_seeds: tuple[int, ...] = (0,)  # the built-in set: each seed adds its new prompts after the others
    data_fractions: tuple[float, ...] = (1.0,)  # several: also train on leading shares of the data, same budget each
    init_head: str | None = None  # self: start from this head (its weights and vocabulary), e.g. on more data
    eval_heads: tuple[str, ...] = ()  # the eval stage: these head directories (else OUT/head) on the held-out split
    target_prompts: int = 0  # also this many user turns the target writes itself (prompts.target_written)
    quantize: str = "auto"  # the target's weights, as the verifier's --quantize: the data is what it serves
    train_precision: str = "auto"  # of the training matmuls (train.train_precision)


def distill(s: DistillSettings, log=print) -> Path:
    given = load_prompts(s.prompts, s.prompt_seeds) if "generate" in s.stages else []  # a bad file fails first
    out = Path(s.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    target_dir = catalog.resolve(s.target_model)
    data_dir = out / "data"
    quantize = weightchoice.resolve(s.quantize, s.target_model, s.dtype, s.device)
    lm = load_model(target_dir, s.dtype, s.device, exact=False, quantize=quantize)
    if "generate" in s.stages:
        prompts = prompt_list(data_dir, given, lm, s, log)
        log(f"generate: {len(prompts)} prompts, up to {s.max_new_tokens} new tokens each, budget {s.gen_minutes} min")
        started = time.monotonic()
        gen.run(lm, prompts, data_dir, s.gen_minutes * 60, s.batch, s.max_new_tokens)
        _note(out, "generate_minutes", (time.monotonic() - started) / 60)
    if s.kind not in ("self", "model"):
        raise ValueError(f"unknown kind {s.kind!r}: self or model")
    fractions = sorted(set(s.data_fractions))
    if not fractions or not all(0 < f <= 1 for f in fractions):
        raise ValueError(f"data fractions must lie in (0, 1], got {list(s.data_fractions)}")
    # The checkpoint and notes of this kind (the data is shared); smaller data fractions of a
    # data-size curve train beside it, each in its own directory; the largest is the one exported.
    dirs = {f: out / (f"{s.kind}-train" if f == 1 else f"{s.kind}-train-data{f:g}") for f in fractions}
    work = dirs[fractions[-1]]
    settings = TrainSettings(budget_s=s.train_minutes * 60, max_steps=s.train_steps, draft_vocab=s.draft_vocab,
                             intermediate=s.head_intermediate,
                             levels=s.levels, lr=s.lr, batch_tokens=s.batch_tokens,
                             precision=train_precision(s.train_precision))
    result, examples, embed, lm_head = None, None, None, None
    if "eval" in s.stages and s.kind != "self":
        raise ValueError("the eval stage compares feature heads (--kind self)")
    if s.kind == "self" and {"train", "eval"} & set(s.stages):  # the very tensors the drafter reads
        embed, lm_head = target_tensors(target_dir, bool(getattr(lm.model.config, "tie_word_embeddings", True)))
    if "train" in s.stages:
        examples = load_examples(data_dir, lm, log)
        result = _train_stage(s, lm, embed, lm_head, examples, dirs, work, settings, out, log)
    if "export" in s.stages:
        work = _export(s, lm, target_dir, out, work, result, log)
    if "eval" in s.stages:
        examples = examples or load_examples(data_dir, lm, log)
        heads = [Path(h) for h in s.eval_heads] or [out / "head"]
        rows = compare(lm, embed, lm_head, examples, heads, settings)
        log(eval_table(rows))
        _note(out, "head_comparison", rows)
    return work


def _train_stage(s: DistillSettings, lm, embed, lm_head, examples: list[dict], dirs: dict[float, Path],
                 work: Path, settings: TrainSettings, out: Path, log) -> dict:
    """Trains one head (or draft model) per data fraction, each in its own directory with the same
    budget; the notes of the largest (`work`, the one exported) and the data-size curve, if several."""
    curve, result = [], None
    for fraction, fdir in dirs.items():
        fdir.mkdir(exist_ok=True)
        fsettings = replace(settings, data_fraction=fraction)
        if s.kind == "self":
            result = train(lm, embed, lm_head, examples, fdir, fsettings, log, init=s.init_head)
        else:
            result = train_standalone(lm, examples, fdir, s.layers, fsettings, log)
        curve.append({"data_fraction": fraction, **result["metrics"]})
    if s.kind == "model":
        _note(work, "layers", result["layers"])
    if s.kind == "self":  # what the run started from, as its checkpoint says (a resumed run too)
        _note(work, "init_head", result["origin"])
    _note(work, "metrics", result["metrics"])
    _note(work, "train_settings", asdict(replace(settings, data_fraction=max(dirs))))
    if len(curve) > 1:  # about the data, not one head: kept beside the data
        _note(out, "data_curve", curve)
        log(curve_table(curve))
    return result


def _export(s: DistillSettings, lm, target_dir: Path, out: Path, work: Path, result, log) -> Path:
    if s.kind == "self":
        export(work, lm, target_dir, s, out / "head")
        log(f"head written to {out / 'head'}")
        return out / "head"
    if result is None:
        raise ValueError("--kind model exports right after training: run the train and export stages together")
    export_standalone(result["module"], target_dir, work, out / "model", _card(work, lm, s))
    log(f"draft model written to {out / 'model'} (use it with --draft-model)")
    return out / "model"


def prompt_list(data_dir: Path, given: list[dict], lm, s: DistillSettings, log=print) -> list[dict]:
    """The data's prompts in shard order, kept in data_dir/prompts.jsonl: the ones kept from earlier
    runs first, then the new ones given (a file or the built-in seeds), then the user turns the target
    writes itself until s.target_prompts of them are kept (appended as they come, so a stopped run
    keeps what it wrote). The list only grows at its end, so every shard already written keeps its
    prompts however the sources change."""
    path = data_dir / "prompts.jsonl"
    data_dir.mkdir(parents=True, exist_ok=True)
    kept = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    seen = {r["prompt"] for r in kept}
    new = [r for r in given if r["prompt"] not in seen and not seen.add(r["prompt"])]
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in new)
        written = sum(r["task_type"] == "target-written" for r in kept + new)
        if s.target_prompts > written:
            log(f"prompts: the target writes {s.target_prompts - written} user turns ({written} kept)")
            for r in target_written(lm, s.target_prompts - written, seed=written, log=log):
                if r["prompt"] not in seen:
                    seen.add(r["prompt"])
                    new.append(r)
                    f.write(json.dumps(r) + "\n")
                    f.flush()
    return kept + new


def eval_table(rows: list[dict]) -> str:
    """Heads side by side: accuracy per drafting step on the held-out split, overall and per task type."""
    kinds = sorted({k for r in rows for k in r["held_out_by_task_type"]})
    lines = [f"held-out accuracy per drafting step (1/2/3), {rows[0]['sequences'] if rows else 0} sequences:",
             f"{'head':<44}{'all':>17}" + "".join(f"{k:>17}" for k in kinds)]

    def cell(acc: list[float]) -> str:
        return "/".join(f"{a:.2f}" for a in acc[:3])

    for r in rows:
        by = r["held_out_by_task_type"]
        lines.append(f"{r['head'][-44:]:<44}{cell(r['held_out_step_accuracy']):>17}"
                     + "".join(f"{cell(by[k]['step_accuracy']) if k in by else '-':>17}" for k in kinds))
    lines.append("sequences per type: " + ", ".join(f"{k} {rows[0]['held_out_by_task_type'][k]['sequences']}"
                                                    for k in kinds if rows and k in rows[0]["held_out_by_task_type"]))
    return "\n".join(lines)


def curve_table(curve: list[dict]) -> str:
    """Held-out accuracy per drafting step against the amount of training data."""
    steps = len(curve[0]["held_out_step_accuracy"])
    lines = [f"{'data':>6}{'sequences':>10}{'tokens':>9}{'steps':>7}"
             + "".join(f"{f'step {k + 1}':>8}" for k in range(steps)) + f"{'est.acc':>8}"]
    for p in curve:
        lines.append(f"{p['data_fraction']:>6.0%}{p['train_sequences']:>10}{p['continuation_tokens']:>9}{p['steps']:>7}"
                     + "".join(f"{a:>8.3f}" for a in p["held_out_step_accuracy"])
                     + f"{p['estimated_acceptance_length_gamma4']:>8.2f}")
    return "\n".join(lines)


def _note(out: Path, key: str, value) -> None:
    notes = _notes(out)
    notes[key] = value
    (out / "recipe.json").write_text(json.dumps(notes, indent=1))


def _notes(work: Path) -> dict:
    path = work / "recipe.json"
    return json.loads(path.read_text()) if path.exists() else {}


def command(s: DistillSettings) -> str:
    """The one command that makes this draft again from the kept data (its stages all run; a stage
    whose work is done resumes as a no-op): every setting that differs from its default, as flags."""
    defaults = DistillSettings(target_model=s.target_model, out=s.out)
    parts = ["specsplit", "distill", "--target-model", s.target_model, "--out", s.out]

    def shown(v) -> str:  # as the flag takes it: 60, not 60.0
        return f"{v:g}" if isinstance(v, float) else str(v)

    for f in fields(DistillSettings):
        value = getattr(s, f.name)
        if f.name in ("target_model", "out", "stages", "eval_heads") or value == getattr(defaults, f.name):
            continue
        parts += [f"--{f.name.replace('_', '-')}",
                  ",".join(shown(v) for v in value) if isinstance(value, tuple) else shown(value)]
    return shlex.join(parts)


def data_made(data_dir: Path) -> dict:
    """The generated data by task type: sequences and continuation tokens (held-out included)."""
    by_type: dict[str, list[int]] = {}
    for path in gen.shard_paths(data_dir):
        for ex in torch.load(path, weights_only=True):
            counts = by_type.setdefault(ex.get("task_type") or "unlabelled", [0, 0])
            counts[0] += 1
            counts[1] += len(ex["ids"]) - ex["prompt_len"]
    return {kind: {"sequences": n, "continuation_tokens": t} for kind, (n, t) in sorted(by_type.items())}


def _card(work: Path, lm, s: DistillSettings) -> dict:
    """What a made draft records: the target it was made for, the recipe (the command that makes it
    again, the data it was made from), the held-out metrics."""
    notes = _notes(work)
    return {"target": {"model_id": lm.model_id, "model_fingerprint": lm.model_fingerprint,
                       "tokenizer_fingerprint": lm.fingerprint},
            "recipe": {"command": command(s), "data": data_made(work.parent / "data"),
                       "kind": s.kind, "prompts": s.prompts or "built-in",
                       "max_new_tokens": s.max_new_tokens, "generate_dtype": s.dtype,
                       "target_prompts": s.target_prompts, "weights": lm.native.kernel if lm.native else "transformers",
                       "train": notes.get("train_settings", {}), **({"target_layers": notes["layers"]}
                                                                        if "layers" in notes else {}),
                       **({"init_head": notes["init_head"]} if notes.get("init_head") else {}),
                       "generate_minutes": _notes(work.parent).get("generate_minutes")},
            "metrics": {**notes.get("metrics", {}), **({"data_curve": _notes(work.parent)["data_curve"]}
                                                        if "data_curve" in _notes(work.parent) else {})}}


def export(out: Path, lm, target_dir: Path, s: DistillSettings, head_dir: Path) -> None:
    """The head's own weights (bfloat16 on disk) and its card: config, the target it was made for,
    the recipe and the measured metrics."""
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    head_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in state["weights"].items()}
    save_file(weights, str(head_dir / "head.safetensors"))
    card = {"format": HEAD_FORMAT,
            "config": HeadConfig.from_target(lm.model.config, int(state["weights"]["vocab_ids"].numel()),
                                             int(state["weights"]["gate_proj.weight"].shape[0])).to_dict(),
            "tied_embeddings": bool(getattr(lm.model.config, "tie_word_embeddings", True)),
            **_card(out, lm, s)}
    (head_dir / "head.json").write_text(json.dumps(card, indent=1) + "\n")
