"""Sampling maths on hand-built distributions: warp edges, acceptance rules, and statistics that a
wrong residual would fail."""

from __future__ import annotations

import pytest
import torch

from specsplit.speculation import acceptance
from specsplit.speculation.acceptance import coupled_accept, rejection_accept
from specsplit.speculation.params import Method, SamplingParams
from specsplit.speculation.sampling import coupled_choice, sample, warp


def dense(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32)


def proposal(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.nonzero(q > 0).flatten()
    return ids, q[ids]


def test_warp_edges():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert torch.equal(warp(logits, SamplingParams(0.0)), dense(1, 0, 0, 0)[None])  # greedy: one-hot
    assert torch.allclose(warp(logits, SamplingParams(1.0)), logits.softmax(-1))
    top1 = warp(logits, SamplingParams(0.7, top_k=1))
    assert torch.equal(top1, dense(1, 0, 0, 0)[None])
    top2 = warp(logits, SamplingParams(1.0, top_k=2))
    assert top2[0, 2:].sum() == 0 and torch.allclose(top2[0, :2], logits[0, :2].softmax(-1))
    p = logits.softmax(-1)[0]  # [0.61, 0.22, 0.14, 0.03]
    assert torch.equal(warp(logits, SamplingParams(1.0, top_p=0.5)), dense(1, 0, 0, 0)[None])  # top token alone
    nucleus = warp(logits, SamplingParams(1.0, top_p=float(p[0] + p[1]) + 1e-4))  # needs three tokens
    assert (nucleus[0] > 0).tolist() == [True, True, True, False]
    assert torch.allclose(warp(logits, SamplingParams(1.0, top_p=1.0)), logits.softmax(-1))
    hot = warp(logits, SamplingParams(100.0))
    assert float(hot.max() - hot.min()) < 0.01  # high temperature flattens
    for bad in (SamplingParams(-1.0), SamplingParams(1.0, top_k=-1), SamplingParams(1.0, top_p=0.0),
                SamplingParams(float("nan"))):
        with pytest.raises(ValueError):
            bad.check()


def test_rejection_cases():
    p = dense(0.5, 0.3, 0.2)
    # q = p: every draft is accepted, then a bonus token.
    for seed in range(50):
        accepted, _, kind = rejection_accept(torch.stack([p, p, p]), [1, 2], [proposal(p)] * 2, seed, 10)
        assert (accepted, kind) == ([0, 1], "bonus")
    # Disjoint supports: always rejected, and the recovered token comes from p.
    q = dense(0.0, 0.0, 1.0)
    p_no2 = dense(0.6, 0.4, 0.0)
    for seed in range(50):
        accepted, token, kind = rejection_accept(torch.stack([p_no2, p_no2]), [2], [proposal(q)], seed, 0)
        assert (accepted, kind) == ([], "recovered") and token in (0, 1)
    # The residual: drafting 1 from q = [.2, .6, .2]: accepted half the time (p/q = .3/.6); when
    # rejected the residual max(0, p - q) = [.3, 0, 0] leaves only token 0.
    q = dense(0.2, 0.6, 0.2)
    outcomes = [rejection_accept(torch.stack([p, p]), [1], [proposal(q)], seed, 0) for seed in range(400)]
    recovered = [t for a, t, k in outcomes if k == "recovered"]
    assert set(recovered) == {0}
    assert 0.4 < len(recovered) / len(outcomes) < 0.6
    with pytest.raises(ValueError, match="probability 0"):
        rejection_accept(torch.stack([p, p]), [0], [proposal(dense(0, 1, 0))], 0, 0)


def test_rejection_over_sibling_drafts_reproduces_the_target_distribution():
    """Two drafts for the same position, drawn independently (one from q, one a point mass): the
    first token's distribution stays p (SpecInfer's multi-step speculative sampling); a rule that
    resamples from p after the siblings are rejected does not."""
    p, q = dense(0.1, 0.2, 0.3, 0.4), dense(0.4, 0.3, 0.2, 0.1)
    point = proposal(dense(0.0, 0.0, 0.0, 1.0))

    def first_token(accept, trials=6000):
        counts = torch.zeros(len(p))
        for seed in range(trials):
            draft = [sample(q, seed, 0, stream=7), 3]
            path, token, _ = accept(torch.stack([p, p, p]), draft, [proposal(q), point], seed, 0, [-1, -1])
            counts[draft[path[0]] if path else token] += 1
        return counts / trials

    assert float((first_token(rejection_accept) - p).abs().sum() / 2) < 0.03

    def broken(probs, draft, proposals, seed, start, parents):  # the siblings' residual forgotten
        for j, child in enumerate((0, 1)):
            ids, qv = proposals[child]
            q_tok = float(qv[ids == draft[child]].sum())
            stream = acceptance.ACCEPT if j == 0 else acceptance.SIBLING_ACCEPT + j
            if acceptance.uniform(seed, start, stream) < min(1.0, float(probs[0][draft[child]]) / q_tok):
                return [child], 0, "bonus"
        return [], sample(probs[0], seed, start), "recovered"

    assert float((first_token(broken) - p).abs().sum() / 2) > 0.04  # 0.058 measured; noise ~0.01


def _first_token_distribution(p, q, trials, accept=rejection_accept):
    counts = torch.zeros(len(p))
    for seed in range(trials):
        draft = [sample(q, seed, 0, stream=7)]  # the drafter's own sample from q
        accepted, token, _ = accept(torch.stack([p, p]), draft, [proposal(q)], seed, 0)
        counts[draft[0] if accepted else token] += 1  # accepted: the path, [0] or []
    return counts / trials


def test_rejection_sampling_reproduces_the_target_distribution_and_a_broken_residual_does_not(monkeypatch):
    p, q = dense(0.1, 0.2, 0.3, 0.4), dense(0.4, 0.3, 0.2, 0.1)
    trials = 6000
    right = _first_token_distribution(p, q, trials)
    assert float((right - p).abs().sum() / 2) < 0.03  # total variation: 0.016 measured (noise ~0.01)

    def broken(probs, draft, proposals, seed, start):  # resamples from p instead of the residual
        ids, qv = proposals[0]
        dense_q = torch.zeros_like(probs[0]).index_put_((ids,), qv)
        token = draft[0]
        if acceptance.uniform(seed, start, acceptance.ACCEPT) < min(1.0, float(probs[0, token] / dense_q[token])):
            return [0], sample(probs[1], seed, start + 1), "bonus"
        return [], sample(probs[0], seed, start), "recovered"

    wrong = _first_token_distribution(p, q, trials, accept=broken)
    assert float((wrong - p).abs().sum() / 2) > 0.08  # 0.13 measured


def test_coupled_choice_samples_p_and_ignores_the_draft():
    p = dense(0.1, 0.2, 0.3, 0.4)
    counts = torch.zeros(4)
    for seed in range(6000):
        counts[coupled_choice(p, seed, 3)] += 1
    assert float((counts / 6000 - p).abs().sum() / 2) < 0.03
    probs = torch.stack([p] * 4)
    for seed in range(30):
        # The committed text is the target's own choices whatever was drafted.
        alone = [coupled_choice(p, seed, 5 + i) for i in range(4)]
        for draft in ([0, 0, 0], alone[:3], [alone[0], 3 - alone[1], alone[2]]):
            path, nxt = coupled_accept(probs, draft, seed, 5)
            assert [draft[i] for i in path] + [nxt] == alone[:len(path) + 1]
        assert coupled_accept(probs, alone[:3], seed, 5) == ([0, 1, 2], alone[3])
        # A tree: two first guesses, each with a child; the walk takes the target's own choices.
        tree = [3 - alone[0], alone[0], alone[1], 3 - alone[1]]
        path, nxt = coupled_accept(torch.stack([p] * 5), tree, seed, 5, [-1, -1, 1, 1])
        assert (path, nxt) == ([1, 2], alone[2])


def test_greedy_is_the_zero_temperature_case_of_coupled():
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, 1.0]])
    probs = warp(logits, SamplingParams(0.0))
    for seed in range(10):
        assert coupled_accept(probs, [1], seed, 0) == acceptance.greedy_accept(logits, [1])


def test_drafter_choice_per_method():
    """choose(): greedy takes argmax q; coupled takes the Gumbel-max choice with the verifier's
    noise; rejection samples from q cut to its top-k and returns exactly that distribution."""
    from draft_service.drafters.base import DraftSession
    from specsplit.speculation.drafting import choose

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    session = DraftSession([7, 8, 9])
    greedy = choose(session, logits, None, 6)
    assert (greedy.token, greedy.q) == (5, None) and greedy.top_prob == pytest.approx(float(logits.softmax(-1)[5]))
    params = SamplingParams(temperature=1.0, seed=4)
    session.sampling = params
    session.drafting = 1
    coupled = choose(session, logits, None, 6)
    assert coupled.token == coupled_choice(warp(logits[None], params)[0], 4, 3 + 1) and coupled.q is None
    session.proposal_top_k = 3
    seen = set()
    for seed in range(40):
        session.sampling = SamplingParams(temperature=1.0, seed=seed, method=Method.REJECTION)
        choice = choose(session, logits, None, 6)
        ids, q = choice.q
        assert sorted(ids.tolist()) == [0, 1, 5] and float(q.sum()) == pytest.approx(1.0)
        assert choice.token in ids.tolist() and choice.top_prob == pytest.approx(float(logits.softmax(-1).max()))
        again = choose(session, logits, None, 6)  # the same (seed, position): the same draw
        assert again.token == choice.token and torch.equal(again.q[1], q)
        seen.add(choice.token)
    assert seen == {0, 1, 5}
    # A draft vocabulary: q's ids are target ids.
    vocab_ids = torch.tensor([10, 20, 30, 40, 50, 60])
    mapped = choose(session, logits, vocab_ids, 100)
    assert set(mapped.q[0].tolist()) == {10, 20, 60} and mapped.token in {10, 20, 60}


def test_nucleus_from_the_top_k_equals_sorting_the_whole_vocabulary():
    torch.manual_seed(0)
    for scale, top_p in ((1.0, 0.9), (0.2, 0.99), (5.0, 0.5), (0.01, 0.999)):  # flat to peaked
        logits = torch.randn(3, 5000) / scale
        x = logits / 0.8
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, probs.cumsum(-1) - probs >= top_p)
        expected = x.masked_fill(drop, float("-inf")).softmax(-1)
        assert torch.equal(warp(logits, SamplingParams(0.8, top_p=top_p)) > 0, expected > 0)
        assert torch.allclose(warp(logits, SamplingParams(0.8, top_p=top_p)), expected)


def test_a_copied_token_drafted_with_q_one_on_it_keeps_the_target_distribution():
    """The verifier's own lookups and forced tokens go with q = 1 on the drafted token
    (verify_service.engine.certain): accepted with probability p(x), else the residual is p
    without x. Whatever token is copied, the output follows p."""
    from verify_service.engine import certain

    p, trials = dense(0.1, 0.2, 0.3, 0.4), 4000
    for copied in (0, 3):
        counts = torch.zeros(len(p))
        for seed in range(trials):
            accepted, token, _ = rejection_accept(torch.stack([p, p]), [copied], certain([copied]), seed, 0)
            counts[copied if accepted else token] += 1
        assert float((counts / trials - p).abs().sum() / 2) < 0.03, (copied, counts / trials)
