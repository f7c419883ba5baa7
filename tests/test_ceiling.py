"""`bench --ceiling`: the verifier's own decode loop in one process, with its lookup and the feature
head drafting, gives spec-off's output token for token, and its table counts what ran."""

from __future__ import annotations

import io

from specsplit.model.modeling import load_model
from specsplit.tools import ceiling
from specsplit.tools.workload import Prompt
from verify_service.engine import Target


def test_every_mode_decodes_spec_offs_tokens_and_the_table_counts_them(models, self_head):
    from draft_service.drafters.selfdraft import SelfDrafter

    lm = load_model(models["target"], "float32")
    target = Target(lm)
    # Every width costs one step: every draft the depth rules allow goes in; no confidence stop.
    curve = [1.0] * 9
    head = SelfDrafter(self_head, models["target"], min_confidence=0.0)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(40, 70))]  # token ids: one that repeats itself
    runs = {}
    for i, ids in enumerate(prompts):
        for mode in ceiling.MODES:
            runs[(i, mode)] = [ceiling.decode(target, ids, 20, mode, curve, head, 4)]
        off = runs[(i, "off")][0]
        assert off.forwards == len(off.tokens) - 1 and off.head_drafted == 0
        for mode in ceiling.MODES[1:]:
            assert runs[(i, mode)][0].tokens == off.tokens, mode
        drafted = runs[(i, "head")][0]
        assert drafted.head_drafted > 0 and drafted.head_accepted <= drafted.head_drafted
        # each forward commits its accepted drafts and one token more (past an EOS too, cut after)
        assert drafted.forwards + drafted.head_accepted >= len(drafted.tokens) - 1
    out = io.StringIO()
    ceiling.print_table([Prompt("a", ""), Prompt("b", "")], runs, ceiling.MODES, out)
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["a", "b", "ALL"]
    assert all(line.split()[-1] == ("2/2" if line.startswith("ALL") else "1/1") for line in lines[1:4])
