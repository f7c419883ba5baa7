"""`bench --ceiling`: the verifier's own decode loop in one process, with its lookup and a neural
drafter (the feature head, or a draft model) built as the draft service builds it, gives spec-off's
output token for token, and its table counts what ran."""

from __future__ import annotations

import io

import pytest

from specsplit.bench import ceiling
from specsplit.bench.workload import Prompt
from specsplit.model.modeling import load_model
from specsplit.serving.settings import DraftSettings, ModelSettings, ServerSettings
from verify_service.engine import Target


@pytest.fixture(scope="module")
def drafters(models, self_head):
    from draft_service.main import build_drafters

    return build_drafters(DraftSettings(ServerSettings(""), ModelSettings(str(models["draft"]), "float32", exact=False),
                                        draft_vocab=0, self_head=str(self_head), target_model=str(models["target"]),
                                        self_min_confidence=0.0))  # no confidence stop: the head always drafts


@pytest.mark.parametrize("kind", ["self", "model"])
def test_every_mode_decodes_spec_offs_tokens_and_the_table_counts_them(models, drafters, kind):
    target = Target(load_model(models["target"], "float32"))
    drafter = drafters[kind]
    curve = [1.0] * 9  # every width costs one step: every draft the depth rules allow goes in
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(40, 70))]  # token ids: one that repeats itself
    runs = {}
    for i, ids in enumerate(prompts):
        for mode in ceiling.MODES:
            runs[(i, mode)] = [ceiling.decode(target, ids, 20, mode, curve, drafter, 4)]
        off = runs[(i, "off")][0]
        assert off.forwards == len(off.tokens) - 1 and off.drafted == 0
        for mode in ceiling.MODES[1:]:
            assert runs[(i, mode)][0].tokens == off.tokens, mode
        alone = runs[(i, "neural")][0]
        assert alone.drafted > 0 and alone.accepted <= alone.drafted
        # each forward commits its accepted drafts and one token more (past an EOS too, cut after)
        assert alone.forwards + alone.accepted >= len(alone.tokens) - 1
    out = io.StringIO()
    ceiling.print_table([Prompt("a", ""), Prompt("b", "")], runs, ceiling.MODES, out)
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["a", "b", "ALL"]
    assert all(line.split()[-1] == ("2/2" if line.startswith("ALL") else "1/1") for line in lines[1:4])
    assert lines[-1].startswith("drafting: ")


def test_under_a_constraint_only_the_drafting_modes_draft_what_it_forces(models):
    """`bench --ceiling --structured`: spec-off chooses every token in the language by a forward of
    its own, as served; the lookup mode also drafts what the language forces, with the same output."""
    from specsplit.api.common.v1 import common_pb2 as cpb
    from specsplit.serving.grammar import Language

    lm = load_model(models["target"], "float32")
    target = Target(lm)
    language = Language(cpb.Constraint(regex=r"The answer is (yes|no), and that is final\."), lm.tokenizer,
                        lm.vocab_size)
    ids = lm.tokenizer("Answer:").input_ids
    off, lookup = (ceiling.decode(target, ids, 40, mode, [1.0] * 9, None, 4, language=language)
                   for mode in ("off", "lookup"))
    assert lookup.tokens == off.tokens
    assert lm.tokenizer.decode(off.tokens, skip_special_tokens=True).startswith("The answer is")
    assert off.forced == 0 and off.forwards == len(off.tokens) - 1
    assert lookup.forced > 0 and lookup.forwards < off.forwards
