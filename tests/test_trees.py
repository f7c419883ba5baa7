"""Token trees: the native forward gives each node the logits of decoding its path alone, the
target verifies a tree and keeps one path, drafters build scored trees, and greedy generation with
trees through the real services is token-identical to generation without speculation."""

import grpc
import pytest
import torch
from conftest import native_model, root_paths, running_stack

from draft_service.drafters.base import DraftSession
from draft_service.drafters.ngram import NgramDrafter, add_continuations
from gateway.load import InFlight, Load
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.model.modeling import KVSequence, load_model
from specsplit.speculation.drafting import Choice, chain_tree
from specsplit.speculation.tokentree import Tree, depths, prune, worth_verifying
from verify_service.engine import Target

PROMPT = [5, 17, 42, 9, 100, 3, 77, 21]
# Row 0 is the last committed token; rows 1.. a tree with two first guesses and uneven branches.
ROWS = [11, 40, 7, 99, 3, 250, 17, 8]
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


PATHS = root_paths(PARENTS)


@pytest.mark.parametrize("model", ["target", "wide"])  # wide: head_dim 32, bf16 pair dot products on bf16
@pytest.mark.parametrize("prompt_len", [8, 40])  # the prefix's keys end inside the first key block, or after two
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_each_tree_node_gets_the_logits_of_its_path_decoded_alone(models, dtype, prompt_len, model, kernel_path):
    """The tree's rows share the prefix's key blocks and the branches' own; each row still gets the
    bits of its path decoded alone."""
    lm = native_model(models, dtype, model)
    prompt = [(PROMPT * 5)[i] + i for i in range(prompt_len)]
    tree = KVSequence(lm)
    tree.forward(prompt)
    logits = tree.forward(ROWS, parents=PARENTS)
    for row in range(len(ROWS)):
        alone = KVSequence(lm)
        alone.forward(prompt)
        last = None
        for r in PATHS[row]:
            last = alone.forward([ROWS[r]])[0]
        assert torch.equal(logits[row], last), f"row {row} (path {PATHS[row]})"


def test_keeping_one_path_leaves_the_cache_of_that_path_alone(models, kernel_path):
    lm = native_model(models, "bfloat16")
    seq = KVSequence(lm)
    seq.forward(PROMPT)
    seq.forward(ROWS, parents=PARENTS)
    seq.keep(len(PROMPT), PATHS[7])
    assert seq.length == len(PROMPT) + len(PATHS[7])
    reference = KVSequence(lm)
    reference.forward(PROMPT + [ROWS[r] for r in PATHS[7]])
    assert torch.equal(seq.forward([5, 6]), reference.forward([5, 6]))
    with pytest.raises(ValueError, match="ascending"):
        seq.keep(len(PROMPT), [2, 1])


def test_target_verifies_a_tree_and_commits_the_branch_it_chose(models):
    lm = native_model(models, "bfloat16")
    target = Target(lm)
    assert target.verifies_trees
    plain, _ = target.prefill(PROMPT)
    for _ in range(6):  # the target's own text, one token at a time
        target.verify(plain, len(plain.tokens), [])
    own = plain.tokens[len(PROMPT):]
    session, first = target.prefill(PROMPT)
    assert first.next_token == own[0]
    # A wrong first guess, then the right one with a wrong and a right child, then a grandchild.
    draft = [own[1] + 1, own[1], own[2] + 1, own[2], own[3]]
    parents = [-1, -1, 1, 1, 3]
    result = target.verify(session, len(session.tokens), draft, parents=parents)
    assert result.path == (1, 3, 4) and result.num_accepted == 3
    assert session.tokens[len(PROMPT):] == own[:5]
    assert session.kv.length == len(session.tokens) - 1
    target.verify(session, len(session.tokens), [])  # decoding goes on from the kept path
    assert session.tokens[len(PROMPT):] == own[:6]
    with pytest.raises(ValueError, match="earlier draft index"):
        target.verify(session, len(session.tokens), [1, 2], parents=[-1, 1])


def test_transformers_forward_refuses_trees(models):
    target = Target(load_model(models["target"], "float32", native=False))
    assert not target.verifies_trees
    session, _ = target.prefill(PROMPT)
    with pytest.raises(ValueError, match="chains only"):
        target.verify(session, len(session.tokens), [1, 2], parents=[-1, -1])


def test_tree_selection_keeps_parents_and_the_best_nodes():
    tree = Tree()
    a = tree.add(-1, 10, 0.9)
    tree.add(a, 11, 0.5)
    tree.add(-1, 20, 0.6)
    b = tree.add(a, 12, 0.8)
    tree.add(b, 13, 0.7)
    assert tree.add(-1, 10, 0.95) == a  # a known child: one node, the higher score
    tokens, parents, scores, _ = tree.select(4, max_depth=3)
    assert tokens == [10, 12, 13, 20] and parents == [-1, 0, 1, -1]
    assert scores == sorted(scores, reverse=True)
    assert tree.select(10, max_depth=1)[0] == [10, 20]
    assert depths([-1, 0, 1, -1, 3]) == [1, 2, 3, 1, 2]
    assert prune([-1, 0, 1, -1, 3], 2) == ([0, 1, 3, 4], [-1, 0, -1, 2])
    assert prune([-1, 0, 1, -1, 3], 3, size=2) == ([0, 1], [-1, 0])
    assert prune([-1, 5, 0, -7, 3], 3) == ([0, 2], [-1, 0])  # a malformed proposal: only its tree part


def test_expected_gain_keeps_the_nodes_that_pay_for_their_rows():
    flat_then_steep = [10.0, 10.2, 10.4, 10.6, 20.0, 30.0]
    assert worth_verifying([0.9, 0.8, 0.7, 0.1, 0.1], flat_then_steep, 1.0) == 3
    assert worth_verifying([0.01, 0.01], flat_then_steep, 1.0) == 0  # 1.01 / 11.2 < 1 / 11
    assert worth_verifying([0.9, 0.9], [], 1.0) == 2  # no cost curve: everything


def test_in_a_shared_forward_a_node_must_pay_for_its_row_across_the_batch():
    """With other sessions' rows in the forward (a batching verifier), the flat part of the cost
    curve is theirs: a node pays only if its chance beats what its row costs the whole batch."""
    curve = [10.0] * 8 + [10.0 + 1.5 * (r - 8) for r in range(9, 65)]  # flat to 8 rows, then 1.5 ms a row
    scores = [0.9, 0.7, 0.5, 0.3, 0.2]
    assert worth_verifying(scores, curve, 1.0) == 5  # alone every row is free
    busy = worth_verifying(scores, curve, 1.0, other_rows=5, other_gain=5.0)  # 5 spec-off sessions
    assert busy == 2  # the free rows left go to the likelier nodes; past them, none pays
    # The batch's 8 tokens per 11 ms against (8 + 0.9) per 12.5 ms for the first node past the flat part.
    assert worth_verifying(scores, curve, 1.0, other_rows=7, other_gain=7.0) == 0
    assert worth_verifying(scores, curve, 1.0, other_rows=30, other_gain=30.0) == 0
    load = Load()
    for sid, (rows, gain) in {"a": (5, 2.5), "b": (1, 1.0), "c": (3, 2.0)}.items():
        load.enter(sid)
        load.report(sid, rows, gain)
    assert load.others("a") == (4, 3.0) and load.others("new") == (9, 5.5)
    load.leave("b")
    load.enter("d")  # a new session counts as a spec-off round until it reports
    assert load.others("a") == (4, 3.0) and (load.rows, load.gain) == (9, 5.5)


def test_retrieval_tree_counts_what_followed_every_occurrence():
    tokens = [1, 2, 5, 6, 9, 1, 2, 5, 7, 9, 1, 2, 5, 6, 9, 1, 2]
    follows, n = NgramDrafter(min_n=1, max_n=3).continuations(DraftSession(tokens), 3)
    assert n == 3 and sorted(follows) == [[5, 6, 9], [5, 7, 9]]  # after [9, 1, 2], latest first
    follows, n = NgramDrafter(min_n=1, max_n=2).continuations(DraftSession(tokens), 3)
    assert n == 2 and sorted(follows) == [[5, 6, 9], [5, 6, 9], [5, 7, 9]]
    tree = Tree()
    add_continuations(tree, follows, 1.0)
    got, parents, scores, _ = tree.select(8, 3)
    assert got[:2] == [5, 6] and parents[:2] == [-1, 0]
    assert scores[0] == pytest.approx(1.0) and scores[1] == pytest.approx(2 / 3)
    assert 7 in got  # the other branch is kept too
    proposal = NgramDrafter().propose(NgramDrafter().start(tokens), 3, budget=4)
    assert proposal.parents is not None and len(proposal.tokens) == 4
    assert proposal.scores == sorted(proposal.scores, reverse=True)


def test_a_model_chain_carries_each_steps_runner_up_as_a_sibling():
    choices = [Choice(5, 0.6, None, 0.6, (8, 0.3)), Choice(6, 0.9, None, 0.9, (9, 0.05))]
    proposal = chain_tree(choices, 8, "model")
    assert proposal.tokens == [5, 6, 8, 9] and proposal.parents == [-1, 0, -1, 0]
    assert proposal.scores == pytest.approx([0.6, 0.54, 0.3, 0.03])
    assert chain_tree(choices, 2, "model").tokens == [5, 6]


# The hybrid's n-gram source makes the copy trees (n-gram alone is drafted in the verifier, as chains).
@pytest.mark.parametrize("drafter", ["hybrid", "model"])
async def test_greedy_generation_with_trees_is_identical_to_spec_off(models, tmp_path, drafter):
    lm = load_model(models["target"], "bfloat16")
    if lm.native is None:
        pytest.skip("token trees need the native forward")
    async with running_stack(tmp_path, "unix", models["target"], models["draft"], tree_budget=8) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            trees = 0
            # the last: what follows its end ("x =") was seen twice, differently: a branching tree
            for text in ("def add(a, b):\n    return a + b\ndef add(", "The quick brown fox. The quick brown",
                         "x = 1\ny = 2\nx = 3\ny = 4\nx ="):
                base = dict(text=text, max_new_tokens=40, drafter=drafter, stop=pb.StopConditions(ignore_eos=True))
                off = await gw.Generate(pb.GenerateRequest(speculation=pb.SPECULATION_OFF, **base))
                on = await gw.Generate(pb.GenerateRequest(speculation=pb.SPECULATION_ON, **base))
                assert list(on.token_ids) == list(off.token_ids)
                assert on.stats.tree_budget == 8
                trees += sum(1 for r in on.stats.round_records if r.drafted > r.depth)
                chain = await gw.Generate(pb.GenerateRequest(speculation=pb.SPECULATION_ON, tree_budget=1, **base))
                assert chain.stats.tree_budget == 0 and list(chain.token_ids) == list(off.token_ids)
            assert trees > 0  # some rounds verified more than one branch
            # To the context's end: a tree's nodes, not only its depth, must fit the cache left.
            base = dict(text="The quick brown fox. The quick brown", max_new_tokens=400, drafter=drafter,
                        stop=pb.StopConditions(ignore_eos=True))
            off = await gw.Generate(pb.GenerateRequest(speculation=pb.SPECULATION_OFF, **base))
            on = await gw.Generate(pb.GenerateRequest(speculation=pb.SPECULATION_ON, **base))
            assert on.finish_reason == off.finish_reason == pb.FINISH_REASON_CONTEXT
            assert list(on.token_ids) == list(off.token_ids)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await gw.Generate(pb.GenerateRequest(text="x", max_new_tokens=4, tree_budget=65))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tree_budget" in bad.value.details()


def test_a_rejection_tree_keeps_its_layout_whatever_was_drawn():
    """Under rejection sampling the siblings are second draws from the same q, placed depth by
    depth after the chain token, never reordered or scored (which drafts are sent must not depend
    on the values drawn); a repeated draw is left out (the verifier would surely reject it)."""
    q = (torch.tensor([3, 5, 8]), torch.tensor([0.5, 0.3, 0.2]))
    choices = [Choice(5, 0.5, q, 0.3, (3, 0.5)), Choice(8, 0.5, q, 0.2, None), Choice(3, 0.5, q, 0.5, (5, 0.3))]
    proposal = chain_tree(choices, 5, "model")
    assert proposal.tokens == [5, 3, 8, 3] and proposal.parents == [-1, -1, 0, 2]
    assert proposal.scores is None and len(proposal.probs) == 4
    assert chain_tree(choices, 3, "model").tokens == [5, 8, 3]  # no room for siblings


def test_in_flight_counts_the_recent_load_not_only_the_instant():
    t = [0.0]
    load = InFlight(tau_s=2.0, clock=lambda: t[0])
    assert load.others() == 0
    for _ in range(8):  # 8 clients back to back for a while
        load.enter()
    t[0] = 20.0
    assert load.others() == 8
    for _ in range(8):  # a lull: all 8 between two requests
        load.leave()
    t[0] = 20.1
    assert load.others() == 7  # the next request will share forwards with the 7 others coming back
    t[0] = 40.0
    assert load.others() == 0  # and once the load has gone, it is gone
    load.enter()
    t[0] = 60.0
    load.leave()
    assert load.others() == 0  # one client alone is alone
