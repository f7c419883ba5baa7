"""Models: `fetch-model` (and the native kernels), `models` (the catalog), `distill` (a self-draft head)."""

from __future__ import annotations

import argparse
import sys

from specsplit.cli.flags import ENV, list_of, threads_flag
from specsplit.errors import UsageError


def add(sub) -> None:
    fm = sub.add_parser("fetch-model", help="fetch a catalog model (pinned, digest checked) and convert it into the "
                                            "cache once; prints its directory")
    fm.add_argument("name", nargs="?", default="default", help="a name `specsplit models` lists (default: the "
                                                               "embedded SmolLM2-135M-Instruct)")
    models = sub.add_parser("models", help="list the catalog: names, source, size, digest, licence, whether fetched")
    models.set_defaults(run=run_models)
    fm.set_defaults(run=run_fetch_model)
    dist = sub.add_parser("distill", help="make a self-draft head for a target from its own continuations")
    dist.set_defaults(run=run_distill)
    dist.add_argument("--target-model", default=ENV("SPECSPLIT_TARGET_MODEL", "default"))
    dist.add_argument("--out", required=True, help="work directory: data shards, checkpoint, head/ (resumable)")
    _data_flags(dist)
    _train_flags(dist)


def _data_flags(dist: argparse.ArgumentParser) -> None:
    """distill's generate stage: which prompts, how the target answers them."""
    dist.add_argument("--prompts", help="JSONL of {prompt, task_type} (default: the built-in distillation set)")
    dist.add_argument("--prompt-seeds", default="0", type=list_of(int, "integers"),
                      help="built-in set: comma-separated seeds, each adding ~1,000 new prompts (new template "
                           "combinations and rewrite passages) after those of the seeds before it, so that a "
                           "resumed run with more seeds keeps its shards and generates more")
    dist.add_argument("--target-prompts", type=int, default=0,
                      help="also this many user turns the target writes itself from its chat template (sampled, "
                           "seeded, deduplicated): prompts in its own users' words for any target; kept in "
                           "OUT/data/prompts.jsonl, so a rerun writes only the ones still missing")
    dist.add_argument("--quantize", default="auto",
                      help="the target's weights while generating and for the features, as the verifier's "
                           "--quantize (auto: what it serves)")
    dist.add_argument("--gen-minutes", type=float, default=30.0, help="budget for generating data")
    dist.add_argument("--max-new-tokens", type=int, default=192, help="continuation length per prompt")
    dist.add_argument("--batch", type=int, default=8, help="prompts generated together")
    dist.add_argument("--dtype", default=ENV("SPECSPLIT_DTYPE", "bfloat16"), help="target dtype while generating")
    dist.add_argument("--device", default=ENV("SPECSPLIT_DEVICE", "cpu"))
    threads_flag(dist)
    dist.add_argument("--stages", default="generate,train,export", type=list_of(str, "stage names"),
                      help="comma-separated subset of generate, train, export, eval to run")


def _train_flags(dist: argparse.ArgumentParser) -> None:
    """distill's train, export and eval stages: the head's shape and its training."""
    dist.add_argument("--data-fractions", default="1", type=list_of(float, "numbers"),
                      help="comma-separated shares of the training data, e.g. 0.25,0.5,1: each trains its own "
                           "head with the same budget and the held-out accuracy of each is printed (a data-size "
                           "curve, kept in the card); the largest is exported")
    dist.add_argument("--init-head", help="--kind self: start from this exported head (its weights and draft "
                                          "vocabulary) instead of the target's last layer, to continue it on "
                                          "more data")
    dist.add_argument("--train-minutes", type=float, default=30.0, help="total training budget (resume adds to it)")
    dist.add_argument("--train-steps", type=int, default=0,
                      help="also stop training at this many steps (0: the time budget alone); a machine's "
                           "load does not change what a step-bounded run learns")
    dist.add_argument("--draft-vocab", type=int, default=8192, help="size of the frequency-ranked draft vocabulary")
    dist.add_argument("--head-intermediate", type=int, default=0,
                      help="the head's MLP width (0: the target's; a big target's head is cheaper to run and "
                           "ship narrower)")
    dist.add_argument("--levels", type=int, default=3, help="drafting steps unrolled in training")
    dist.add_argument("--lr", type=float, default=6e-4)
    dist.add_argument("--batch-tokens", type=int, default=1024, help="tokens per training step")
    dist.add_argument("--train-precision", choices=["auto", "float32", "bfloat16"], default="auto",
                      help="the training matmuls (weights and optimizer stay float32): auto takes bfloat16 "
                           "where the CPU multiplies it natively (AVX-512 BF16, AMX, Arm BF16)")
    dist.add_argument("--eval-heads", default="", type=list_of(str, "head directories"),
                      help="the eval stage: comma-separated heads (directories, or `default` for the one shipped "
                           "for the target) to compare on the held-out split, per task type (default: OUT/head)")
    dist.add_argument("--kind", choices=["self", "model"], default="self",
                      help="self: a feature head (--drafter self/hybrid); model: a standalone draft model of "
                           "--layers target layers (--draft-model DIR/model)")
    dist.add_argument("--layers", type=int, default=2, help="target layers a standalone draft keeps (--kind model)")


def run_distill(a: argparse.Namespace) -> int:
    from specsplit.distill.pipeline import DistillSettings, distill
    from specsplit.model.headfile import resolve_head
    from specsplit.serving import runtime

    runtime.configure_process(a.threads, "distill")
    stages = a.stages
    unknown = set(stages) - {"generate", "train", "export", "eval"}
    if unknown:
        raise UsageError(f"unknown stages {sorted(unknown)}; choose from generate, train, export, eval")
    distill(DistillSettings(target_model=a.target_model, out=a.out, prompts=a.prompts, gen_minutes=a.gen_minutes,
                            train_minutes=a.train_minutes, train_steps=a.train_steps,
                            max_new_tokens=a.max_new_tokens, batch=a.batch,
                            draft_vocab=a.draft_vocab, head_intermediate=a.head_intermediate, levels=a.levels,
                            lr=a.lr, dtype=a.dtype, device=a.device,
                            stages=stages, kind=a.kind, layers=a.layers, batch_tokens=a.batch_tokens,
                            prompt_seeds=a.prompt_seeds, data_fractions=a.data_fractions,
                            target_prompts=a.target_prompts, quantize=a.quantize, train_precision=a.train_precision,
                            init_head=str(resolve_head(a.init_head, a.target_model)) if a.init_head else None,
                            eval_heads=tuple(str(resolve_head(h, a.target_model)) for h in a.eval_heads)))
    return 0


def run_fetch_model(a: argparse.Namespace) -> int:
    import logging

    from specsplit.model import catalog

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(catalog.fetch(a.name))
    _build_native()
    return 0


def run_models(a: argparse.Namespace) -> int:
    """One block per catalog entry: what it is, where it comes from, whether it is fetched, and which
    weights a target start serves it from (`--quantize auto`) once that was measured here."""
    import json

    from specsplit.model import catalog, weightchoice
    from specsplit.model.headfile import shipped_head

    for e in catalog.MODELS.values():
        where = catalog.model_dir(e.name)
        fetched = (where / "config.json").is_file()
        print(f"{e.name}\n  {e.title}; licence {e.licence}\n  source: {e.source}")
        if e.sha256:
            print(f"  file: {e.file_bytes:,} bytes, sha256 {e.sha256}")
        print(f"  converted to {e.dtype}: {f'ready in {where}' if fetched else 'not fetched'}")
        choice = weightchoice.recorded(where) if fetched else None
        print(f"  served (--quantize auto, bfloat16): {choice.why if choice else weightchoice.UNMEASURED}")
        head = shipped_head(e.name)
        if (head / "head.json").is_file():
            acc = json.loads((head / "head.json").read_text()).get("metrics", {}).get("held_out_step_accuracy", [])
            print(f"  feature head: shipped ({head.name}; held-out accuracy per drafting step "
                  f"{' / '.join(f'{a:.2f}' for a in acc) or 'unrecorded'}): --self-head auto drafts with it")
        else:
            print(f"  feature head: none shipped (make one with `specsplit distill --target-model {e.name}`)")
    return 0


def _build_native() -> None:
    """Builds the native kernels once (cached), so services do not each wait for the compiler."""
    import time

    import torch

    from specsplit.model import native

    reason = native.unavailable(torch.float32, torch.device("cpu"))
    if reason:
        print(f"native kernels: not used here ({reason})", file=sys.stderr)
        return
    started = time.perf_counter()
    native.module()
    print(f"native kernels: {native.describe()}, ready in {time.perf_counter() - started:.1f} s ({native.cache_dir()})",
          file=sys.stderr)
