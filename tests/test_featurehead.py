"""The feature head: serving (incremental, with a cache) computes exactly what training unrolls."""

import copy

import pytest
import torch
from conftest import random_head, root_paths

from specsplit.model.featurehead import FeatureHead, HeadCache, HeadConfig, head_step, unrolled_forward


def test_drafting_steps_match_the_unrolled_training_forward():
    head = random_head()
    t, n = 12, 7  # sequence length; the committed prefix holds n features
    feats, tokens = torch.randn(1, t, 32), torch.randint(0, 50, (1, t))
    with torch.no_grad():
        levels = unrolled_forward(head, feats, tokens, 3)
    cache = HeadCache()
    pred = head_step(head, cache, feats[0, :n], tokens[0, :n].tolist())[-1]  # step 1 at position n-1
    assert torch.allclose(pred, levels[0][0, n - 1], atol=1e-5)
    for s in (2, 3):  # step s sits at position n+s-2 and reads the previous step's prediction
        pred = head_step(head, cache, pred[None], [int(tokens[0, n + s - 2])])[-1]
        assert torch.allclose(pred, levels[s - 1][0, n + s - 2], atol=1e-5), s


def test_rolling_the_cache_back_forgets_drafted_steps():
    head = random_head(1)
    feats, tokens = torch.randn(10, 32), torch.randint(0, 50, (10,)).tolist()
    cache = HeadCache()
    first = head_step(head, cache, feats[:6], tokens[:6])
    head_step(head, cache, first[-1:], [tokens[6]])  # a drafted step
    cache.truncate(6)
    again = head_step(head, cache, feats[6:8], tokens[6:8])
    fresh = head_step(head, HeadCache(), feats[:8], tokens[:8])
    assert torch.allclose(again, fresh[6:8], atol=1e-5)


def test_identity_init_predicts_the_current_feature():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=50)
    head = FeatureHead(HeadConfig.from_target(config, 16))
    head.init_from_target_layer(LlamaDecoderLayer(config, 0).state_dict())
    head.attach(torch.randn(50, 32), torch.randn(50, 32), torch.arange(16))
    feats = torch.randn(5, 32)
    out = head_step(head, HeadCache(), feats, [1, 2, 3, 4, 5])
    assert torch.allclose(out, feats, atol=1e-6)


def test_self_session_keeps_features_aligned_with_committed_tokens():
    from draft_service.drafters.selfdraft import SelfSession

    session = SelfSession([1, 2, 3], dim=4)
    session.sync(3, [9])  # first generated token: features may now cover positions 0..2
    session.add_features(0, torch.ones(3, 4))
    session.cached = 3
    session.sync(4, [5, 6])  # a round committed two tokens; their features come next
    session.add_features(3, torch.full((2, 4), 2.0))
    assert session.features.shape == (5, 4) and session.cached == 3
    session.add_features(3, torch.full((2, 4), 3.0))  # a retried delivery replaces, not appends
    assert session.features.shape == (5, 4) and float(session.features[4, 0]) == 3.0 and session.cached == 3
    session.sync(5, [7])  # a retried round from position 5 drops the feature of position 5 onwards
    assert session.features.shape == (5, 4) and session.cached == 3
    import pytest

    with pytest.raises(ValueError, match="no feature yet"):
        session.add_features(5, torch.zeros(1, 4))  # position 5 is the last token: not computed yet
    with pytest.raises(ValueError, match="start at position 7"):
        session.add_features(7, torch.zeros(1, 4))
    with pytest.raises(ValueError, match="inside the 3-token prompt"):
        session.sync(2, [1])


QUANT_CASES = [(torch.float32, 1e-4, ""), (torch.bfloat16, 0.05, ""), (torch.bfloat16, 0.1, "q8_0"),
              (torch.bfloat16, 0.15, "q4_0")]


def _skip_unless_runs(dtype, quantize):
    from specsplit.model import native

    why = native.unavailable(dtype, torch.device("cpu")) or (quantize and native.lacks_vnni())
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("dtype,tol,quantize", QUANT_CASES)
def test_native_serving_computes_what_torch_serving_computes(dtype, tol, quantize, kernel_path):
    """The native kernels run the head's layer and draft logits as head_step + logits do, through
    a prefix, drafted steps and a rollback (bfloat16 weights: within bf16 rounding; q8_0 weights
    and activations, as the head is served where the CPU has VNNI; q4_0 on AVX2: within theirs)."""
    from specsplit.model.headserving import NativeHead, TorchHead

    _skip_unless_runs(dtype, quantize)
    head = random_head(0, head_dim=16)
    runners = (TorchHead(head), NativeHead(head, 64, dtype, quantize))
    caches = [r.new_cache() for r in runners]
    feats, tokens = torch.randn(10, 32), torch.randint(0, 50, (10,)).tolist()

    def both(features, next_tokens):
        (a, la), (b, lb) = (r.step(c, features, next_tokens) for r, c in zip(runners, caches))
        a_tol, l_tol = tol * max(1.0, float(a.abs().max())), tol * max(1.0, float(la.abs().max()))
        assert torch.allclose(a, b.float(), atol=a_tol) and torch.allclose(la, lb, atol=l_tol)
        return a

    out = both(feats[:6], tokens[:6])
    out = both(out[-1:], [tokens[6]])  # drafted steps
    both(out[-1:], [tokens[7]])
    for c in caches:
        c.truncate(6)
    both(feats[6:9], tokens[6:9])
    assert caches[0].length == caches[1].length == 9


@pytest.mark.parametrize("quantize", ["q8_0", "q4_0"])
def test_a_quantized_heads_best_logits_are_computed_from_its_float_rows(quantize, kernel_path):
    """Served in blocks, a head's output rows round its logits and move its picks; each row's 8 best
    logits are computed again from bfloat16 rows, so those are the float head's own, and the rest
    stay what the blocks give."""
    from specsplit.model.headserving import NativeHead

    _skip_unless_runs(torch.float32, quantize)
    head = random_head(0, head_dim=16)
    runner = NativeHead(head, 64, torch.float32, quantize)
    feats, tokens = torch.randn(6, 32), torch.randint(0, 50, (6,)).tolist()
    hidden, refined = runner.step(runner.new_cache(), feats, tokens)
    runner.decoder.set_exact_head(torch.empty(0))  # none: the blocks' logits as they are
    _, blocks = runner.step(runner.new_cache(), feats, tokens)
    exact = hidden[-1].float() @ head.vocab_weight.to(torch.bfloat16).float().T
    best = blocks.topk(8).indices
    rest = torch.ones(16, dtype=torch.bool)
    rest[best] = False
    assert torch.allclose(refined[best], exact[best], rtol=1e-5, atol=1e-5)
    assert torch.equal(refined[rest], blocks[rest])
    assert not torch.allclose(blocks[best], exact[best], rtol=1e-5, atol=1e-5)  # the blocks did round them


@pytest.mark.parametrize("dtype,tol,quantize", QUANT_CASES)
def test_a_tree_grown_over_several_head_steps_equals_feeding_each_path_alone(dtype, tol, quantize, kernel_path):
    """NativeHead.tree_step: rows whose parents are slots of earlier calls (a draft tree grown
    depth by depth, EAGLE-2 style) get what a chain feed of their path gives (up to the rounding of
    the head's input projection, a torch GEMM whose result depends on the rows in the call)."""
    from specsplit.model.headserving import NativeHead

    _skip_unless_runs(dtype, quantize)
    head = random_head(1, head_dim=16)
    runner = NativeHead(head, 64, dtype, quantize)
    feats, tokens = torch.randn(12, 32), torch.randint(0, 50, (12,)).tolist()
    tree = runner.new_cache()
    runner.step(tree, feats[:5], tokens[:5])
    base = tree.length
    # Depth 1: two roots (slots base, base + 1); depth 2: children of each (slots base + 2, + 3);
    # depth 3: a child of slot base + 3.
    out1, logits1 = runner.tree_step(tree, feats[5:7], tokens[5:7], [-1, -1], base, [])
    out2, logits2 = runner.tree_step(tree, out1, tokens[7:9], [-2 - base, -2 - (base + 1)], base, [-1, -1])
    out3, logits3 = runner.tree_step(tree, out2[1:], tokens[9:10], [-2 - (base + 3)], base, [-1, -1, base, base + 1])
    chain = runner.new_cache()
    runner.step(chain, feats[:5], tokens[:5])
    a, la = runner.step(chain, feats[6:7], tokens[6:7])  # root 2
    b, lb = runner.step(chain, a, tokens[8:9])  # its child
    c, lc = runner.step(chain, b, tokens[9:10])  # and grandchild
    def same(x, y):
        return torch.allclose(x.float(), y.float(), atol=tol * max(1.0, float(y.abs().max())))

    assert same(out1[1], a[0]) and same(logits1[1], la)
    assert same(out2[1], b[0]) and same(logits2[1], lb)
    assert same(out3[0], c[0]) and same(logits3[0], lc)
    assert not same(logits3[0], la)  # the comparison can tell two nodes apart
    with pytest.raises(RuntimeError, match="slot"):
        runner.tree_step(tree, out1[:1], tokens[:1], [-2 - (base + 99)], base, [-1] * (tree.length - base))


def _round(runner, head, feats, tokens, gamma, min_confidence=0.0, width=0):
    from specsplit.model.headserving import HeadRound

    cache = runner.new_cache()
    drafted = runner.run([HeadRound(cache, feats, tokens, [], None, gamma, min_confidence, width, 0.05)])[0]
    return cache, drafted


@pytest.mark.parametrize("min_confidence", [0.0, 0.4])
def test_a_native_round_drafts_the_greedy_chain_its_head_computes(kernel_path, min_confidence):
    """NativeHead.draft: the whole chain in one call. Each token is the argmax of the head's draft
    logits on the chain so far (as torch computes them step by step), its top probability that
    step's softmax maximum, and drafting stops exactly before the running product of top
    probabilities falls below min_confidence; the cache holds the fed rows."""
    from specsplit.model.headserving import NativeHead, TorchHead

    head = random_head(2, head_dim=16)
    native = NativeHead(head, 64, torch.float32)
    feats, tokens = torch.randn(6, 32), torch.randint(0, 50, (6,)).tolist()
    cache, drafted = _round(native, head, feats, tokens, 5, min_confidence)
    chain = drafted.chain
    torch_head = TorchHead(head)
    ref = torch_head.new_cache()
    pred, logits = torch_head.step(ref, feats, tokens)
    assert torch.allclose(drafted.last[1], logits, atol=1e-4) and torch.allclose(drafted.last[0], pred[-1], atol=1e-4)
    confidence = 1.0
    for k in range(5):
        probs = logits.softmax(-1)
        if confidence * float(probs.max()) < min_confidence:
            break
        confidence *= float(probs.max())
        assert chain.tokens[k] == int(head.vocab_ids[int(logits.argmax())])
        assert chain.top_probs[k] == pytest.approx(float(probs.max()), abs=1e-4)
        second = int(probs.topk(2).indices[1])
        assert chain.runner_ups[k] == int(head.vocab_ids[second])
        pred, logits = torch_head.step(ref, pred[-1:], [chain.tokens[k]])
    else:
        k = 5
    assert len(chain.tokens) == k and 0 < k and (min_confidence == 0) == (k == 5)
    # the target rows, then each drafted token but a fifth (whose step was never needed)
    assert cache.length == 6 + min(k, 4)


def test_a_native_round_grows_the_tree_the_step_by_step_drafter_grows(kernel_path):
    """The dynamic tree in one call: the same nodes, parents and path probabilities (up to the
    rounding of the input projection) as SelfDrafter._expand growing it one head call a depth."""
    from types import SimpleNamespace

    from draft_service.drafters.base import drive
    from draft_service.drafters.selfdraft import MIN_EXPAND, WIDTH, SelfDrafter, SelfSession
    from specsplit.model.headserving import NativeHead

    head = random_head(3, head_dim=16)
    native = NativeHead(head, 64, torch.float32)
    feats, tokens = torch.randn(6, 32), torch.randint(0, 50, (6,)).tolist()
    cache, drafted = _round(native, head, feats, tokens, 4, width=WIDTH)
    session = SelfSession(tokens, 32, native.new_cache())
    pred, logits = native.step(session.cache, feats, tokens)
    steps = SelfDrafter._expand(SimpleNamespace(head=head), session, session.cache, pred[-1], logits, 4, 64)
    expected = drive(steps, native)
    tree = drafted.tree
    assert len(tree.tokens) > WIDTH  # it grew past the first depth
    assert all(s >= 0 for s in tree.scores) and all(-1 <= p < i for i, p in enumerate(tree.parents))
    from specsplit.speculation.tokentree import Tree

    nodes = Tree()
    for parent, token, score in zip(*tree):
        nodes.add(parent, token, score)
    got = nodes.select(64, 4)
    assert got[0] == expected.tokens and got[1] == expected.parents
    assert got[2] == pytest.approx(expected.scores, abs=1e-4)
    assert cache.length == session.cache.length and MIN_EXPAND > 0


@pytest.mark.parametrize("min_confidence", [0.0, 0.3])
def test_a_sequence_held_in_the_kernels_drafts_what_the_python_track_drafts(kernel_path, min_confidence):
    """The verifier's head state in the kernels (NativeHead.sequence: begin, follow, draft) drafts,
    round after round, the chains HeadTrack and NativeHead.run draft from the same committed tokens
    and features: steps that accept some of a draft, none, or all, a step that commits several
    tokens at once, and a draft right after another with nothing committed between."""
    from specsplit.model.headserving import HeadTrack, NativeHead

    head = random_head(5, head_dim=16)
    runner = NativeHead(head, 128, torch.float32)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (9,), generator=gen).tolist()  # a prompt of 8 and the first token
    feats = torch.randn(8, 32, generator=gen)
    sequence, track = runner.sequence(), HeadTrack(32, runner.new_cache(), len(tokens))
    sequence.begin(tokens, feats)
    track.put_features(0, feats, len(tokens))

    def both(gamma):
        drafted = runner.run([track.round(tokens, gamma, min_confidence, 0, 0.05)])[0]
        track.took(drafted)
        got = sequence.draft(gamma, min_confidence)
        assert got == drafted.chain.tokens
        return got

    drafted_any = 0
    for new in (1, 3, 0, 2, 4, 1, 0, 1):  # tokens a step commits after its draft's first ones
        draft = both(4)
        drafted_any += len(draft)
        length = len(tokens)
        if new == 0:  # nothing committed: the next draft follows from the same state
            continue
        tokens = tokens[:length] + draft[:new - 1] + torch.randint(0, 50, (new - len(draft[:new - 1]),),
                                                                    generator=gen).tolist()
        step_feats = torch.randn(len(tokens) - length, 32, generator=gen)
        sequence.follow(length, tokens[length:], step_feats)
        track.cut(length)
        track.put_features(length - 1, step_feats, len(tokens))
    assert drafted_any and sequence.length == len(tokens)
    with pytest.raises(RuntimeError, match="the last committed token has no feature"):
        sequence.follow(len(tokens), [7], torch.randn(2, 32))
    # It keeps only the features its cache does not hold yet: a step never rolls back past what it
    # committed, and one that would is refused, not drafted from features it dropped.
    with pytest.raises(RuntimeError, match="which the head's cache holds"):
        sequence.follow(3, [7], torch.randn(1, 32))


def test_the_verifiers_head_drafts_only_tokens_worth_their_measured_price(kernel_path):
    """VerifierHead prices its rounds (Price: a fixed part and a part per drafted token, fitted over
    its rounds, one cut to nothing included) and drafts as deep as Agreement.depth says pays at that
    price: free, it drafts its whole gamma where rows cost nothing; priced above what a round can
    earn, it drafts nothing and runs no round at all."""
    from specsplit.model.headserving import NativeHead
    from verify_service.headdraft import OUTLIER, Price, VerifierHead

    price = Price()
    assert price.parts == (0.0, 0.0)  # nothing measured: drafting is free
    price.add(0.3, 1)
    assert price.parts == pytest.approx((0.3, 0.0))  # one size seen: all of it the round's
    for ms, n in ((0.5, 3), (0.2, 0), (0.6, 4), (0.4, 2)):  # 0.2 ms a round + 0.1 a token, exactly
        price.add(ms, n)
    price.add(0.3, 1)
    assert price.parts == pytest.approx((0.2, 0.1))
    preempted, slow = copy.deepcopy(price), copy.deepcopy(price)
    preempted.add(50.0, 1)  # a round a neighbour held up for 50 ms counts as OUTLIER times its price
    slow.add(OUTLIER * 0.3, 1)
    assert preempted.parts == pytest.approx(slow.parts) and preempted.parts[0] + preempted.parts[1] < 1.0

    head = random_head(4, head_dim=16)
    verifier = VerifierHead(NativeHead(head, 64, torch.float32), "random", gamma=3, min_confidence=0.0)
    feats, tokens = torch.randn(6, 32), torch.randint(0, 50, (7,)).tolist()
    flat = [3.0] * 8  # a forward costs the same at every width
    state = verifier.start(tokens[:6])
    verifier.prefilled(state, tokens, feats)
    drafted = verifier.draft(state, 8, flat)
    assert len(drafted.tokens) == 3 and drafted.ns > 0  # its gamma, the room allowing; timed
    assert verifier.price.w == 1 and verifier.price.ms == pytest.approx(drafted.ns / 1e6)  # priced at that time
    verifier.price = Price()
    verifier.price.add(2.7, 1)  # dearer than its gamma of 3 tokens earn at an even rate and 3 ms (2.625)
    assert verifier.draft(state, 8, flat) == ([], 0, None)
    assert verifier.price.w == 1  # no round ran


def test_the_verifiers_head_is_priced_at_start_from_warm_rounds_after_forwards(models):
    """VerifierHead.measure: before any request, rounds of one and gamma tokens after 1-row forwards
    of the target price the head (the cold first pass left out), and its session's cache is given
    back; a request's first round then drafts at that price."""
    from conftest import native_model

    from specsplit.model.featurehead import FeatureHead, HeadConfig
    from specsplit.model.headserving import NativeHead
    from verify_service.engine import Target
    from verify_service.headdraft import DECAY, WARMUP_PASSES, VerifierHead

    lm = native_model(models, "float32")
    torch.manual_seed(0)
    cfg = HeadConfig(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16, rope_theta=10000.0,
                     eps=1e-5, draft_vocab=32)
    head = FeatureHead(cfg)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    head.attach(torch.randn(lm.vocab_size, 64), torch.randn(lm.vocab_size, 64), torch.arange(32))
    verifier = VerifierHead(NativeHead(head.eval(), 256, torch.float32), "random", gamma=4, min_confidence=0.0)
    target = Target(lm)
    used = lm.native.pool.used_bytes
    verifier.measure(target, 1)
    assert lm.native.pool.used_bytes == used  # the measuring session's cache is given back
    rounds = 2 * (WARMUP_PASSES - 1)
    assert verifier.price.w == pytest.approx(sum(DECAY ** i for i in range(rounds)))
    # a round of 1 token, then of gamma (no confidence stop: every token drafted), the latest weighed most
    assert verifier.price.n == pytest.approx(sum(DECAY ** (rounds - 1 - i) * (1, 4)[i % 2] for i in range(rounds)))
    fixed, per = verifier.price.parts
    assert fixed >= 0 and per >= 0 and fixed + per > 0


def test_the_verifiers_head_grows_a_tree_and_verifies_the_part_that_pays(kernel_path):
    """VerifierHead with a width: EAGLE-2's dynamic tree from the sequence in the kernels, best
    first (parents before children), at most as deep as asked; at a flat forward cost every node
    pays and the whole tree is kept, at a cost per row only its likeliest nodes are; a
    session whose trees earn less than their scores promised has its scores scaled down."""
    from specsplit.model.headserving import NativeHead
    from specsplit.speculation import tokentree
    from verify_service.headdraft import MIN_EXPAND, VerifierHead

    head = random_head(6, head_dim=16)
    runner = NativeHead(head, 64, torch.float32)
    gen = torch.Generator().manual_seed(1)
    feats, tokens = torch.randn(6, 32, generator=gen), torch.randint(0, 50, (7,), generator=gen).tolist()
    whole = runner.sequence()
    whole.begin(tokens, feats)
    parents, made, scores = whole.draft_tree(3, 3, MIN_EXPAND)  # every node the kernels grow, uncut

    def paths(ps, ts):
        return {tuple(ts[j] for j in path) for path in root_paths(ps)}

    drafts = {}
    for name, curve in (("flat", [3.0] * 8), ("steep", [3.0 + 1.0 * r for r in range(8)])):
        verifier = VerifierHead(runner, "random", gamma=3, min_confidence=0.0, width=3)  # unpriced: drafts 3 deep
        state = verifier.start(tokens[:6])
        verifier.prefilled(state, tokens, feats)
        drafts[name] = verifier.draft(state, 8, curve)
        d = drafts[name]
        tokentree.check(d.parents, len(d.tokens))
        assert state.looked == max(tokentree.depths(d.parents), default=0) <= 3
        assert paths(d.parents, d.tokens) <= paths(parents, made)  # nodes of the kernels' tree, paths kept
    assert not tokentree.is_chain(drafts["flat"].parents)  # branched
    assert len(drafts["flat"].tokens) == len(made)  # all of it: every node adds to the rate at no cost
    assert len(drafts["steep"].tokens) < len(drafts["flat"].tokens)  # the likeliest first, then cut
    assert drafts["steep"].tokens == drafts["flat"].tokens[:len(drafts["steep"].tokens)]
    with pytest.raises(ValueError, match="head width 17"):
        VerifierHead(runner, "random", gamma=3, min_confidence=0.0, width=17)
    state = verifier.start(tokens[:6])
    verifier.prefilled(state, tokens, feats)
    assert state.scale == 1.0
    verifier.draft(state, 8, [3.0] * 8)
    verifier.follow(state, len(tokens), tokens + [5], torch.randn(1, 32), accepted=0)
    assert state.scale < 1.0 and state.looked == 0
