"""`specsplit distill` on a tiny target: data, training, resume, export, and the head's card."""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import DISTILL_PROMPTS, write_prompts

from draft_service.drafters.selfdraft import SelfDrafter
from specsplit.distill import gen
from specsplit.distill.prompts import builtin_prompts, load_prompts
from specsplit.distill.train import (
    TrainSettings,
    build_vocab,
    evaluate,
    load_examples,
    load_head,
    split,
    train,
    train_precision,
)
from specsplit.distill.train import features as train_features
from specsplit.model.headfile import target_tensors
from specsplit.model.identity import weights_fingerprint
from specsplit.model.modeling import load_model
from specsplit.speculation.drafting import Proposal


@pytest.fixture(scope="module")
def data(models, tmp_path_factory):
    lm = load_model(models["target"], "float32", exact=False)
    work = tmp_path_factory.mktemp("data")
    gen.run(lm, load_prompts(str(write_prompts(work / "p.jsonl"))), work / "data", 60, 4, 24)
    return lm, work


def test_generated_features_reproduce_the_targets_own_tokens(data):
    lm, work = data
    shards = [ex for path in gen.shard_paths(work / "data") for ex in torch.load(path, weights_only=True)]
    assert shards and all(set(ex) == {"ids", "prompt_len", "task_type"} for ex in shards)  # ids only
    # The features the generating forwards computed are cached beside the shards ...
    cached = load_examples(work / "data")
    assert len(cached) == 8
    for ex in cached:
        assert ex["features"].shape == (len(ex["ids"]) - 1, lm.hidden_size)
        # The feature at position i is what the target read to choose token i+1.
        cont = slice(ex["prompt_len"] - 1, None)
        chosen = lm.model.lm_head(ex["features"][cont].float()).argmax(-1)
        assert torch.equal(chosen, ex["ids"][ex["prompt_len"]:].long())
    # ... and are the very ones one prefill per sequence gives (rows do not depend on their batch).
    prefilled = train_features(lm, shards)
    assert all(torch.equal(ex["features"], f) for ex, f in zip(cached, prefilled))


def test_missing_features_are_computed_once_and_cached(data, tmp_path):
    lm, work = data
    (tmp_path / "data").mkdir()
    for path in gen.shard_paths(work / "data"):
        (tmp_path / "data" / path.name).write_bytes(path.read_bytes())  # the ids alone, as a clone has them
    with pytest.raises(ValueError, match="no features cached"):
        load_examples(tmp_path / "data")
    first = load_examples(tmp_path / "data", lm, log=lambda *_: None)
    assert all(gen.features_path(p).is_file() for p in gen.shard_paths(tmp_path / "data"))
    again = load_examples(tmp_path / "data")  # no target needed the second time
    assert all(torch.equal(a["features"], b["features"]) for a, b in zip(first, again))


def test_training_lowers_the_loss_and_resumes_from_its_checkpoint(data, models):
    lm, work = data
    embed, head = target_tensors(models["target"], tied=False)
    settings = TrainSettings(budget_s=600, max_steps=40, draft_vocab=128, batch_tokens=256, lr=3e-3)
    examples = load_examples(work / "data", lm, log=lambda *_: None)
    first = train(lm, embed, head, examples, work, settings, log=lambda *_: None)
    losses = first["losses"]
    assert len(losses) == 40 == first["metrics"]["steps"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    again = train(lm, embed, head, examples, work, TrainSettings(**{**vars(settings), "max_steps": 50}),
                  log=lambda *_: None)
    assert len(again["losses"]) == 10 and again["metrics"]["steps"] == 50  # continued, not restarted
    assert torch.equal(again["head"].vocab_ids, first["head"].vocab_ids)


def test_bf16_matmuls_train_the_same_fp32_head(data, models, tmp_path, monkeypatch):
    lm, work = data
    embed, head = target_tensors(models["target"], tied=False)
    settings = TrainSettings(budget_s=600, max_steps=40, draft_vocab=128, batch_tokens=256, lr=3e-3,
                             precision="bfloat16")
    result = train(lm, embed, head, load_examples(work / "data", lm, log=lambda *_: None), tmp_path, settings,
                   log=lambda *_: None)
    losses = result["losses"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert {p.dtype for p in result["head"].parameters()} == {torch.float32}  # autocast, not a bf16 head
    # auto: bf16 only where the CPU multiplies it natively
    import specsplit.model.native as native
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert train_precision("auto") == "float32"
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert train_precision("auto") == "bfloat16" == train_precision("bfloat16")
    with pytest.raises(ValueError, match="unknown training precision 'fp8'"):
        train_precision("fp8")


def test_draft_vocabulary_maps_back_to_target_ids(data):
    lm, work = data
    examples = load_examples(work / "data", lm, log=lambda *_: None)
    vocab = build_vocab(examples, 128, lm.eos_token_ids, lm.vocab_size)
    assert vocab.numel() == 128 and len(set(vocab.tolist())) == 128
    assert all(0 <= t < lm.vocab_size for t in vocab.tolist()) and set(lm.eos_token_ids) <= set(vocab.tolist())
    to_draft = {t: i for i, t in enumerate(vocab.tolist())}
    produced = {t for ex in examples for t in ex["ids"][ex["prompt_len"]:].tolist()}
    for t in produced & set(to_draft):
        assert int(vocab[to_draft[t]]) == t  # target id -> draft index -> the same target id
    # The most frequent continuation tokens come first.
    assert max(produced, key=lambda t: sum(ex["ids"][ex["prompt_len"]:].tolist().count(t) for ex in examples)) \
        in vocab[:len(lm.eos_token_ids) + 1].tolist()


def test_held_out_split_stays_put_as_the_data_grows():
    def seq(prompt: list[int], cont: list[int]) -> dict:
        return {"ids": torch.tensor(prompt + cont), "prompt_len": len(prompt)}

    examples = [seq([i, i + 1, i + 2], [7, 8]) for i in range(200)]
    settings = TrainSettings(budget_s=1, held_out_every=5)
    train_small, held_small = split(examples[:100], settings)
    train_all, held_all = split(examples, settings)
    def ids(xs: list[dict]) -> list[tuple]:
        return [tuple(x["ids"].tolist()) for x in xs]

    def prompts(xs: list[dict]) -> set[tuple]:
        return {tuple(x["ids"][:x["prompt_len"]].tolist()) for x in xs}

    assert 10 < len(held_all) < 70 and set(ids(held_small)) <= set(ids(held_all))
    assert ids(train_all)[:len(train_small)] == ids(train_small)  # grown data: the old sequences come first
    # The same prompt generated twice (another seed) never sits on both sides.
    twice = examples + [seq([i, i + 1, i + 2], [9]) for i in range(200)]
    train_twice, held_twice = split(twice, settings)
    assert not prompts(train_twice) & prompts(held_twice)
    half, held_half = split(examples, TrainSettings(budget_s=1, held_out_every=5, data_fraction=0.5))
    assert ids(half) == ids(train_all)[:round(len(train_all) / 2)] and ids(held_half) == ids(held_all)


def test_exported_head_records_its_target_and_loads(self_head, models):
    card = json.loads((self_head / "head.json").read_text())
    assert card["target"]["model_fingerprint"] == weights_fingerprint(models["target"])
    assert card["metrics"]["steps"] > 0
    # The one command that makes it again: the settings it was made with, whatever ran the stages.
    command = shlex.split(card["recipe"]["command"])
    assert command[:2] == ["specsplit", "distill"] and "--stages" not in command
    flags = dict(zip(command[2::2], command[3::2]))
    assert flags["--target-model"] == str(models["target"]) and flags["--out"] == str(self_head.parent)
    assert (flags["--data-fractions"], flags["--head-intermediate"], flags["--draft-vocab"]) == ("0.5,1", "96", "128")
    assert flags["--train-minutes"] == "0.1" and "--lr" not in flags  # defaults left out
    # The data it was made from, by task type (every prompt of the file is "test").
    data = card["recipe"]["data"]
    assert list(data) == ["test"] and data["test"]["sequences"] == len(DISTILL_PROMPTS)
    assert data["test"]["continuation_tokens"] >= card["metrics"]["continuation_tokens"]  # held-out too
    assert card["config"]["intermediate"] == 96  # --head-intermediate, narrower than the target's 128
    # Made with --data-fractions 0.5,1: both heads trained on their share, same held-out set.
    curve = card["metrics"]["data_curve"]
    assert [p["data_fraction"] for p in curve] == [0.5, 1.0]
    assert 0 < curve[0]["train_sequences"] < curve[1]["train_sequences"] == card["metrics"]["train_sequences"]
    assert all(len(p["held_out_step_accuracy"]) == 3 for p in curve)
    assert (self_head.parent / "self-train-data0.5" / "checkpoint.pt").is_file()
    drafter = SelfDrafter(self_head, models["target"])
    session = drafter.start([5, 6, 7])
    session.sync(3, [8])
    session.add_features(0, torch.zeros(3, card["config"]["hidden"]))
    proposal = drafter.propose(session, 4)
    assert len(proposal.tokens) == 4 and proposal.source == "self"
    drafter.min_confidence = 1.01  # no chain is that sure: the head drafts nothing rather than guess
    assert drafter.propose(session, 4) == Proposal([], "")


def test_default_names_the_head_shipped_for_the_target_given():
    from specsplit.errors import UsageError
    from specsplit.model.headfile import resolve_head, shipped_head

    assert resolve_head("default").name == "smollm2-135m-instruct-self"  # the embedded default's
    qwen = resolve_head("default", "qwen2.5-coder-1.5b-instruct")
    assert qwen == shipped_head("qwen2.5-coder-1.5b-instruct") and (qwen / "head.json").is_file()
    from specsplit.model import catalog  # a target named by its directory in the catalog's cache

    assert resolve_head("default", str(catalog.resolve(catalog.DEFAULT))) == resolve_head("default")
    with pytest.raises(UsageError, match="no head is shipped for target qwen2.5-coder-0.5b-instruct"):
        resolve_head("default", "qwen2.5-coder-0.5b-instruct")


def test_a_head_loaded_with_fewer_output_rows_keeps_its_most_frequent_and_drafts_only_those(self_head, models):
    """--head-vocab N: the first N rows of the frequency-ranked draft vocabulary (fewer bytes a step)."""
    from specsplit.model.headfile import load_head

    whole, card = load_head(self_head, models["target"])
    trimmed, _ = load_head(self_head, models["target"], vocab=64)
    assert len(whole.vocab_ids) == card["config"]["draft_vocab"] == 128
    assert torch.equal(trimmed.vocab_ids, whole.vocab_ids[:64]) and trimmed.vocab_weight.shape[0] == 64
    assert torch.equal(trimmed.vocab_weight, whole.vocab_weight[:64])
    assert load_head(self_head, models["target"], vocab=1000)[0].vocab_ids.numel() == 128  # no more than it has
    drafter = SelfDrafter(self_head, models["target"], vocab=64)
    allowed = set(whole.vocab_ids[:64].tolist())
    session = drafter.start([5, 6, 7])
    session.sync(3, [8])
    session.add_features(0, torch.randn(3, card["config"]["hidden"]))
    proposal = drafter.propose(session, 4)
    assert proposal.tokens and set(proposal.tokens) <= allowed


def test_a_head_for_other_weights_is_refused(self_head, models):
    # "draft" shares the target's tokenizer but not its weights.
    with pytest.raises(ValueError, match="was trained for target .* retrain it"):
        SelfDrafter(self_head, models["draft"])


def test_builtin_prompts_are_varied_and_hold_out_the_starter_prompts():
    from importlib.resources import files

    prompts = builtin_prompts()
    starter = {json.loads(line)["prompt"] for line in
               files("specsplit").joinpath("data/starter_prompts.jsonl").read_text().splitlines() if line.strip()}
    assert len(prompts) > 1000 and len({p["prompt"] for p in prompts}) == len(prompts)
    assert {p["task_type"] for p in prompts} == {"code", "structured", "rewrite", "open"}
    assert not starter & {p["prompt"] for p in prompts}
    assert {p["task_type"] for p in prompts[:8]} == {"code", "structured", "rewrite", "open"}  # balanced prefix


def test_standalone_draft_learns_exports_and_drafts_in_its_vocabulary(data, models, tmp_path):
    from draft_service.drafters.model import ModelDrafter, draft_vocabulary
    from specsplit.distill.pipeline import DistillSettings, distill
    from specsplit.distill.standalone import layer_subset, train_standalone

    assert layer_subset(30, 2) == [0, 29] and layer_subset(30, 4) == [0, 10, 19, 29] and layer_subset(2, 4) == [0, 1]
    lm, work = data
    settings = TrainSettings(budget_s=600, max_steps=30, draft_vocab=128, batch_tokens=256, lr=3e-3)
    examples = load_examples(work / "data", lm, log=lambda *_: None)
    result = train_standalone(lm, examples, tmp_path / "model-work", 1, settings, log=lambda *_: None)
    losses = result["losses"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    # The whole command: reuses generated data, exports an HF dir with the draft vocabulary.
    (tmp_path / "data").symlink_to(work / "data")
    model_dir = distill(DistillSettings(target_model=str(models["target"]), out=str(tmp_path), kind="model",
                                        layers=1, stages=("train", "export"), train_minutes=0.05, draft_vocab=128,
                                        dtype="float32"), log=lambda *_: None)
    card = json.loads((model_dir / "draft.json").read_text())
    assert card["recipe"]["kind"] == "model" and card["recipe"]["target_layers"] == [1]
    vocab = draft_vocabulary(model_dir)
    drafter = ModelDrafter(load_model(model_dir, "float32", exact=False, head_ids=vocab), vocab_ids=vocab)
    assert drafter.vocab_ids is not None and drafter.vocab_ids.numel() == 128
    session = drafter.start([5, 6, 7])
    session.sync(3, [8])
    drafts = drafter.propose(session, 4).tokens
    assert len(drafts) == 4 and set(drafts) <= set(drafter.vocab_ids.tolist())


def test_more_prompt_seeds_append_new_prompts_after_the_old_ones():
    first, more = load_prompts(None), load_prompts(None, (0, 1))
    assert more[:len(first)] == first and len(more) > len(first) + 300
    assert len({r["prompt"] for r in more}) == len(more)


def test_a_head_continues_from_an_exported_one(data, models, self_head, tmp_path):
    from safetensors.torch import load_file, save_file

    lm, work = data
    embed, head = target_tensors(models["target"], tied=False)
    examples = load_examples(work / "data", lm, log=lambda *_: None)
    settings = TrainSettings(budget_s=600, max_steps=5, draft_vocab=64, batch_tokens=256, lr=3e-3)
    # The exported head with its vocabulary ranked backwards, as if ranked on other (first, smaller) data.
    stale = tmp_path / "stale"
    shutil.copytree(self_head, stale)
    weights = load_file(str(stale / "head.safetensors"))
    save_file({**weights, "vocab_ids": weights["vocab_ids"].flip(0).contiguous()}, str(stale / "head.safetensors"))
    runs = {}
    for name, init in (("continued", stale), ("fresh", None)):
        (tmp_path / name).mkdir()
        runs[name] = train(lm, embed, head, examples, tmp_path / name, settings, log=lambda *_: None, init=init)
    # The exported head's vocabulary size (128), not the settings' (64), ranked on this run's training
    # sequences (its output rows are the target's: nothing of the old ranking is worth keeping); its
    # trained weights.
    ranked = build_vocab(split(examples, settings)[0], 128, lm.eos_token_ids, lm.vocab_size)
    assert torch.equal(runs["continued"]["head"].vocab_ids, ranked)
    assert not torch.equal(ranked, weights["vocab_ids"].flip(0))
    assert runs["continued"]["losses"][0] < runs["fresh"]["losses"][0]
    assert runs["continued"]["origin"]["head"] == stale.name and runs["fresh"]["origin"] is None
    # Resumed from its checkpoint with the same command, the run goes on where it stopped, in the
    # exported head's shape and the vocabulary it trained on, and still says what it started from.
    resumed = train(lm, embed, head, examples, tmp_path / "continued", replace(settings, max_steps=7),
                    log=lambda *_: None, init=stale)
    assert len(resumed["losses"]) == 2 and resumed["metrics"]["steps"] == 7
    assert resumed["origin"] == runs["continued"]["origin"]
    assert torch.equal(resumed["head"].vocab_ids, ranked)


def test_held_out_accuracy_is_the_targets_pick_over_its_whole_vocabulary(data, models, self_head):
    """A hit is the head's pick equal to the target's greedy token over all of its vocabulary (what the
    verifier accepts): where the target picks a token outside the draft vocabulary, the head misses,
    however it ranks the tokens it has."""
    from specsplit.model.featurehead import unrolled_forward

    lm, work = data
    embed, lm_head = target_tensors(models["target"], tied=False)
    held = split(load_examples(work / "data", lm, log=lambda *_: None), TrainSettings(budget_s=1))[1]
    student = load_head(lm, embed, lm_head, self_head, TrainSettings(budget_s=1))

    def by_hand() -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1's picks and the target's, position by position, sequence by sequence."""
        head, picks, truths = student.module, [], []
        with torch.no_grad():
            for ex in held:
                f = ex["features"].float()
                positions = torch.arange(max(ex["prompt_len"] - 2, 0), len(f) - 1)  # row i: f_{i+1}'s token
                out = unrolled_forward(head, f[None], ex["ids"][1:len(f) + 1].long()[None], 1)[0][0]
                picks.append(head.vocab_ids[head.logits(out[positions]).argmax(-1)])
                truths.append((f[positions + 1] @ lm_head.float().T).argmax(-1))
        return torch.cat(picks), torch.cat(truths)

    student.ready()
    pick, truth = by_hand()
    assert evaluate(student, held, student.settings)[0][0] == pytest.approx(float((pick == truth).float().mean()),
                                                                            abs=1.5 / len(truth))
    # The target's most frequent pick taken out of the draft vocabulary: every position where the
    # target picks it is a miss (the draft vocabulary's own best there is no hit).
    common = int(truth.mode().values)
    kept = [t for t in student.module.vocab_ids.tolist() if t != common]
    student.vocab = torch.tensor(kept + [t for t in range(lm.vocab_size) if t not in kept and t != common][:1])
    student.ready()
    pick, truth = by_hand()
    assert (truth == common).any() and not ((pick == truth) & (truth == common)).any()
    assert evaluate(student, held, student.settings)[0][0] == pytest.approx(float((pick == truth).float().mean()),
                                                                            abs=1.5 / len(truth))


def test_continuous_batching_decodes_each_prompt_as_alone(models):
    """A sequence's slot is refilled mid-run and rows of different lengths share forwards: each
    continuation is still the one the prompt gets decoded by itself."""
    lm = load_model(models["target"], "float32", exact=False)
    prompts = [[3 + i, 40 + 2 * i, 7] * (1 + i % 3) for i in range(7)]
    together = dict(gen.decode_native(lm, prompts, 20, slots=3))
    alone = {i: dict(gen.decode_native(lm, [p], 20, slots=1))[0] for i, p in enumerate(prompts)}
    with_features = {i: (c, f) for i, c, f in gen.decode_native(lm, prompts, 20, slots=3, features=True)}
    assert {i: c for i, (c, _) in with_features.items()} == together
    assert all(f.shape == (len(prompts[i]) + len(c) - 1, lm.hidden_size) for i, (c, f) in with_features.items())
    assert together == alone and sorted(together) == list(range(7))
    assert all(0 < len(c) <= 20 for c in together.values())
    seq = lm.native.sequence()  # greedy: each token is the argmax after the ones before it
    cont = together[4]
    logits = seq.forward(prompts[4] + cont[:-1])
    assert logits[len(prompts[4]) - 1:].argmax(-1).tolist() == cont


def test_the_prompt_list_only_grows_at_its_end_and_shards_must_match_it(models, tmp_path):
    from specsplit.distill.pipeline import DistillSettings, prompt_list

    lm = load_model(models["target"], "float32", exact=False)
    quiet = dict(log=lambda *_: None)
    first = [{"task_type": "a", "prompt": f"p{i}"} for i in range(5)]
    settings = DistillSettings(target_model=str(models["target"]), out=str(tmp_path))
    assert prompt_list(tmp_path, first, lm, settings, **quiet) == first
    # Other sources later: what was kept stays in place, the new ones follow, repeats are dropped.
    later = [{"task_type": "b", "prompt": p} for p in ("q0", "p3", "q1")]
    grown = prompt_list(tmp_path, later, lm, settings, **quiet)
    assert [r["prompt"] for r in grown] == ["p0", "p1", "p2", "p3", "p4", "q0", "q1"]
    # The target writes its own user turns up to the count asked, once: a rerun writes none.
    written = prompt_list(tmp_path, [], lm, DistillSettings(**{**vars(settings), "target_prompts": 3}), **quiet)
    mine = [r for r in written if r["task_type"] == "target-written"]
    assert written[:7] == grown and 0 < len(mine) <= 3 and len({r["prompt"] for r in mine}) == len(mine)
    assert prompt_list(tmp_path, [], lm, DistillSettings(**{**vars(settings), "target_prompts": len(mine)}),
                       **quiet) == written
    gen.run(lm, written, tmp_path, 60, 4, 6)
    assert len(gen.shard_paths(tmp_path)) == (len(written) + 3) // 4
    with pytest.raises(ValueError, match="does not continue prompt 0"):
        gen.check_shards(lm.tokenizer, written[1:], tmp_path, 4)


def test_the_eval_stage_compares_heads_per_task_type_on_the_held_out_split(self_head, models, tmp_path):
    """`distill --stages eval`: each head's accuracy on the held-out prompts, overall and per task
    type (the types' sequences add up to the split), each head's own (a zeroed copy is told apart
    from the head it was copied from), and the comparison kept in the work directory's notes."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specsplit.distill.pipeline import DistillSettings, distill

    broken = tmp_path / "broken"
    shutil.copytree(self_head, broken)
    weights = load_file(str(broken / "head.safetensors"))
    save_file({k: v * 0 if v.is_floating_point() else v for k, v in weights.items()}, str(broken / "head.safetensors"))
    work = self_head.parent
    printed = []
    distill(DistillSettings(target_model=str(models["target"]), out=str(work), dtype="float32", stages=("eval",),
                            eval_heads=(str(self_head), str(broken))), log=printed.append)
    rows = json.loads((work / "recipe.json").read_text())["head_comparison"]
    assert [r["head"] for r in rows] == [str(self_head), str(broken)]
    lm = load_model(models["target"], "float32", exact=False)
    held = split(load_examples(work / "data", lm, log=lambda *_: None), TrainSettings(budget_s=1))[1]
    for r in rows:
        assert r["sequences"] == len(held) > 0
        assert sum(k["sequences"] for k in r["held_out_by_task_type"].values()) == len(held)
        assert set(r["held_out_by_task_type"]) == {ex["task_type"] for ex in held}
    # Each row is its head's own accuracy on exactly those prompts (the zeroed copy is its own head).
    embed, lm_head = target_tensors(models["target"], tied=False)
    for r, head in zip(rows, (self_head, broken)):
        student = load_head(lm, embed, lm_head, head, TrainSettings(budget_s=1))
        student.ready()
        overall, by_type = evaluate(student, held, student.settings)
        assert r["held_out_step_accuracy"] == [round(a, 4) for a in overall] and r["held_out_by_task_type"] == by_type
        # The overall figure is every position's, whichever type it belongs to.
        kinds = {ex["task_type"] for ex in held}
        alone = [evaluate(student, [ex for ex in held if ex["task_type"] == k], student.settings)[0] for k in kinds]
        assert min(a[0] for a in alone) - 1e-9 <= overall[0] <= max(a[0] for a in alone) + 1e-9
    assert "held-out accuracy per drafting step" in printed[-1] and str(broken)[-20:] in printed[-1]


def test_the_data_samplers_draws_are_a_served_requests_for_its_seed():
    """gen.Sampler draws as a served request with that seed does (speculation.sampling's warp and
    stream), only among the top k, and greedy at temperature 0."""
    from specsplit.distill.gen import Sampler
    from specsplit.speculation.params import SamplingParams
    from specsplit.speculation.sampling import sample, warp

    rows = torch.randn(40, 300, generator=torch.Generator().manual_seed(1))
    sampler, other = Sampler(0.9, 5, seed=11), Sampler(0.9, 5, seed=12)
    draws = [sampler(row, -1) for row in rows]
    params = SamplingParams(temperature=0.9, top_k=5, seed=11)
    assert draws == [sample(warp(row[None], params)[0], 11, i) for i, row in enumerate(rows, 1)]
    assert all(d in row.topk(5).indices.tolist() for d, row in zip(draws, rows))
    assert len(set(draws)) > 5 and draws != [other(row, -1) for row in rows]
    assert Sampler(0.0)(rows[0], 7) == 7
