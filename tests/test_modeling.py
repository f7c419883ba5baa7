"""Numerics and rollback on a tiny random model, through the real loading code."""


import pytest
import torch

from draft_service.drafters.model import ModelDrafter
from specsplit.model.identity import tokenizer_fingerprint
from specsplit.model.modeling import FlatLinear, KVSequence, RowInvariantLinear, load_model
from specsplit.model.native import PATHS
from verify_service.engine import Target
from verify_service.steps import LengthMismatch

PROMPT = [5, 17, 42, 9, 100, 3, 77, 21]


# (dtype, quantize, kernel path): every weight format on every path (AMX runs bf16 GEMMs only).
KERNEL_PATHS = [("bfloat16", "", "amx")] + [(dtype, quantize, path) for path in PATHS if path != "amx"
                                            for dtype, quantize in (("bfloat16", ""), ("float32", ""),
                                                                    ("bfloat16", "q8_0"), ("bfloat16", "q4_0"))]


def _kernel_path(monkeypatch, dtype: str, quantize: str, path: str) -> None:
    """Forces one native kernel path (SPECSPLIT_ISA), or skips naming what this CPU lacks (pytest
    -rs lists them)."""
    from specsplit.model import native

    monkeypatch.setenv("SPECSPLIT_ISA", path)
    monkeypatch.delenv("SPECSPLIT_AMX", raising=False)
    reason = native.unavailable(getattr(torch, dtype), torch.device("cpu"))
    if not reason and quantize:
        reason = native.lacks_vnni()
    if reason:
        pytest.skip(f"kernel path {dtype} {quantize or ''} {path} not tested on this CPU: {reason}")


@pytest.mark.parametrize("model", ["target", "wide"])
@pytest.mark.parametrize("dtype,quantize,path", KERNEL_PATHS)
def test_prefill_in_chunks_gives_the_same_cache_and_logits(models, monkeypatch, dtype, quantize, path, model):
    """One prefill call, or the same prompt in chunks of any size: bit-identical KV cache and logits
    (chunked prefill may interleave with other sessions' rounds without changing a thing)."""
    _kernel_path(monkeypatch, dtype, quantize, path)
    lm = load_model(models[model], dtype, quantize=quantize)
    assert lm.native is not None and (path == "amx") == ("AMX" in lm.native.kernel)
    prompt = [(7 * i + 3) % 250 for i in range(53)]
    whole = KVSequence(lm)
    expected = whole.forward(prompt)
    for cuts in ([1, 52], [16, 16, 16, 5], [17, 30, 6]):
        seq, got, at = KVSequence(lm), [], 0
        for n in cuts:
            got.append(seq.forward(prompt[at:at + n]))
            at += n
        assert torch.equal(torch.cat(got), expected), cuts
        assert torch.equal(seq._buffer.kv[..., :len(prompt), :, :], whole._buffer.kv[..., :len(prompt), :, :]), cuts


@pytest.mark.parametrize("dtype,quantize,path", KERNEL_PATHS)
def test_results_do_not_depend_on_the_thread_count(models, monkeypatch, dtype, quantize, path):
    """decoder.cpp shares GEMM panels and attention tasks out over the OpenMP team: 1, 2 or 3
    threads give the same bits (prefill and a 5-row verify)."""
    _kernel_path(monkeypatch, dtype, quantize, path)
    lm = load_model(models["wide"], dtype, quantize=quantize)
    prompt = [(5 * i + 2) % 250 for i in range(70)]
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            seq = KVSequence(lm)
            outs.append((seq.forward(prompt), seq.forward([4, 9, 16, 25, 36])))
    finally:
        torch.set_num_threads(threads)
    for n, (prefill, verify) in zip((2, 3), outs[1:]):
        assert torch.equal(prefill, outs[0][0]) and torch.equal(verify, outs[0][1]), n


@pytest.mark.parametrize("model", ["target", "wide"])
@pytest.mark.parametrize("dtype,quantize,path", KERNEL_PATHS)
def test_verifying_k_tokens_is_bit_identical_to_decoding_them_one_by_one(models, monkeypatch, dtype, quantize, path,
                                                                        model):
    _kernel_path(monkeypatch, dtype, quantize, path)
    lm = load_model(models[model], dtype, quantize=quantize)
    one = KVSequence(lm)
    one.forward(PROMPT)
    tokens, singles = [11], []
    for _ in range(20):
        singles.append(one.forward(tokens[-1:])[0])  # [vocab]
        tokens.append(int(singles[-1].argmax()))
    for width in (5, 17):  # a verify of 5 rows (a chain) and of 17 (more than a tile)
        many = KVSequence(lm)
        many.forward(PROMPT)
        chunked = torch.cat([many.forward(tokens[i:i + width]) for i in range(0, 20, width)])[:20]  # [20, vocab]
        assert torch.equal(torch.stack(singles), chunked), width


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_transformers_fallback_is_exact_too(models, dtype):
    """Where the native kernels cannot run, transformers' forward (eager attention, row-invariant
    linears) keeps verification bit-identical to one-by-one decoding."""
    lm = load_model(models["target"], dtype, native=False)
    assert lm.native is None
    _one_by_one_equals_verified(lm)


TOKENS = [11, 40, 7, 99, 3, 250, 17, 8]


def _one_by_one_equals_verified(lm) -> torch.Tensor:
    """Asserts that decoding TOKENS one by one after PROMPT gives bit-identical logits to verifying
    them in blocks of 5 and 3; returns those logits [8, vocab]."""
    one, many = KVSequence(lm), KVSequence(lm)
    one.forward(PROMPT)
    many.forward(PROMPT)
    singles = torch.stack([one.forward([t])[0] for t in TOKENS])
    assert torch.equal(singles, torch.cat([many.forward(TOKENS[:5]), many.forward(TOKENS[5:])]))
    return singles


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_native_kernels_run_where_the_cpu_has_them(models, dtype, monkeypatch):
    """The tripwire: on a CPU that can run them, the kernels build and serve, whatever the suite's
    SPECSPLIT_NATIVE says (a run with the fallback switched on still checks them here)."""
    from specsplit.model import native

    monkeypatch.delenv("SPECSPLIT_NATIVE", raising=False)
    lm = load_model(models["target"], dtype)
    if native.unavailable(lm.dtype, lm.device):
        pytest.skip(native.unavailable(lm.dtype, lm.device))
    assert lm.kernels == "native" and lm.native is not None
    assert type(KVSequence(lm)).__name__ == "FastSequence"


@pytest.mark.parametrize("cls", [FlatLinear, RowInvariantLinear])
def test_swapped_linears_compute_what_nn_linear_computes(cls):
    torch.manual_seed(0)
    plain = torch.nn.Linear(32, 48)
    x = torch.randn(3, 7, 32)
    last = x[:1, -1:, :]  # a one-row view with the long tensor's strides, as logits_to_keep makes
    expected, expected_last = plain(x), plain(last)
    plain.__class__ = cls
    assert torch.allclose(plain(x), expected, atol=1e-5)
    assert plain(last).shape == (1, 1, 48) and torch.allclose(plain(last), expected_last, atol=1e-5)


def test_target_rollback_matches_a_from_scratch_forward(models):
    """After rounds with partial acceptance, the cache and the next logits equal a fresh prefill of
    the committed tokens."""
    lm = load_model(models["target"], "float32")
    target = Target(lm)
    session, _ = target.prefill(PROMPT)
    # Round 1: an arbitrary draft (usually rejected at once).
    length = len(session.tokens)
    result = target.verify(session, length, [1, 2, 3])
    assert result.length == length + result.num_accepted + 1
    # Round 2: draft exactly what the target would say next (so it is accepted) plus a wrong token.
    fresh = KVSequence(lm)
    guess = int(fresh.forward(session.tokens, last_only=True)[0].argmax())
    wrong = (guess + 1) % lm.vocab_size
    result = target.verify(session, result.length, [guess, wrong, 4])
    assert result.num_accepted == 1
    assert session.kv.length == len(session.tokens) - 1

    scratch = KVSequence(lm)
    scratch.forward(session.tokens[:-1])
    # The caches agree where it shows: every later position's logits attend over all of them (a
    # stale key left behind by the rollback, or one missing, moves every row below).
    later = [*session.tokens[-1:], 5, 6, 7, 8]
    ours, theirs = session.kv.forward(later), scratch.forward(later)
    assert ours.shape == theirs.shape == (len(later), lm.vocab_size)
    assert torch.equal(ours, theirs)  # the same kernels on the same cache: bit for bit
    assert session.kv.length == scratch.length == len(session.tokens) + 4


def test_target_features_are_those_of_the_committed_positions(models):
    """With features on, the session commits the same tokens, and the feature rows returned by
    prefill and verify are the final-norm hidden states of positions [0, length - 1), in order."""
    lm = load_model(models["target"], "bfloat16")
    target = Target(lm)
    plain, first = target.prefill(PROMPT)
    session, first_f = target.prefill(PROMPT, with_features=True)
    assert first_f.next_token == first.next_token and first_f.features.shape == (len(PROMPT), lm.hidden_size)
    rows = [first_f.features]
    for draft in ([5, 6, 7], [session.tokens[-1]] * 2, []):
        length = len(session.tokens)
        result = target.verify(session, length, draft)
        assert target.verify(plain, length, draft).next_token == result.next_token
        assert result.features.shape == (result.num_accepted + 1, lm.hidden_size)
        rows.append(result.features)
    got = torch.cat(rows)
    assert got.shape[0] == len(session.tokens) - 1
    ids = torch.tensor([session.tokens[:-1]])
    expected = lm.model.model(input_ids=ids).last_hidden_state[0]
    assert torch.allclose(got.float(), expected.float(), atol=0.1)
    assert torch.equal(lm.model.lm_head(expected[-1:]).argmax(-1), torch.tensor([session.tokens[-1]]))


def test_verify_refuses_a_stale_length(models):
    target = Target(load_model(models["target"], "bfloat16"))
    session, _ = target.prefill(PROMPT)
    with pytest.raises(LengthMismatch):
        target.verify(session, len(session.tokens) - 1, [1])


def test_model_drafter_follows_rollbacks(models):
    """The drafter's cache after accept/reject cycles equals a fresh forward of the committed tokens."""
    lm = load_model(models["draft"], "float32", exact=False)
    drafter = ModelDrafter(lm)
    session = drafter.start(PROMPT)
    session.sync(len(PROMPT), [11])
    drafts = drafter.propose(session, 4).tokens
    assert len(drafts) == 4
    # The target accepted two of them and chose 99 instead of the third.
    session.sync(len(PROMPT) + 1, drafts[:2] + [99])
    again = drafter.propose(session, 3).tokens
    fresh = KVSequence(lm)
    logits = fresh.forward(session.tokens, last_only=True)
    assert again[0] == int(logits[0].argmax())
    keep = len(session.tokens) + len(again) - 1
    assert session.kv.length == keep


def test_fingerprint_tells_tokenizers_apart(models):
    target, draft, foreign = (load_model(models[k], "float32").tokenizer for k in ("target", "draft", "foreign"))
    assert tokenizer_fingerprint(target) == tokenizer_fingerprint(draft)
    assert tokenizer_fingerprint(target) != tokenizer_fingerprint(foreign)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.1)])
@pytest.mark.parametrize("prompt_len", [8, 40])  # 40: past the rowwise limit, prefill takes the masked path
@pytest.mark.parametrize("model", ["target", "wide"])
def test_exact_numerics_compute_the_same_model(models, dtype, tol, prompt_len, model):
    """Exact mode changes kernels, not the function: logits stay close to transformers' SDPA path."""
    prompt = [(7 * i + 3) % 250 for i in range(prompt_len)]
    logits = {}
    for exact in (True, False):  # the default (native where it runs) vs transformers' SDPA path
        seq = KVSequence(load_model(models[model], dtype, exact=exact, native=exact))
        logits[exact] = torch.cat([seq.forward(prompt), seq.forward([1, 2, 3])])  # [prompt_len + 3, vocab]
    assert torch.allclose(logits[True], logits[False], atol=tol, rtol=0)


def _decode(target, session, rounds, drafter):
    for _ in range(rounds):
        draft, proposals = drafter(session)
        target.verify(session, len(session.tokens), draft, proposals)
    return session.tokens


def test_coupled_sampling_commits_the_same_text_whatever_is_drafted(models):
    from specsplit.speculation.params import SamplingParams

    target = Target(load_model(models["target"], "float32"))
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    plain, _ = target.prefill(PROMPT, sampling=params)
    alone = _decode(target, plain, 24, lambda s: ([], None))
    drafted, _ = target.prefill(PROMPT, sampling=params)
    # Wrong guesses, right guesses (the committed text itself), anything: the text does not move.
    guesses = iter(range(10**6))
    together = _decode(target, drafted, 12, lambda s: ([alone[len(s.tokens)] if len(s.tokens) < len(alone) else 1,
                                                         next(guesses) % 50, 3], None))
    assert together == alone[:len(together)] and len(together) > len(PROMPT) + 12
    other, _ = target.prefill(PROMPT, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=8))
    assert _decode(target, other, 24, lambda s: ([], None)) != alone  # the seed matters


def test_rejection_sampling_session_needs_a_proposal_per_draft_token(models):
    import torch

    from specsplit.speculation.params import Method, SamplingParams

    target = Target(load_model(models["target"], "float32"))
    params = SamplingParams(temperature=1.0, seed=3, method=Method.REJECTION)
    session, _ = target.prefill(PROMPT, sampling=params)
    with pytest.raises(ValueError, match="one proposal distribution per draft token"):
        target.verify(session, len(session.tokens), [5, 6])
    certain = (torch.tensor([5]), torch.tensor([1.0]))  # a deterministic drafter: q is one-hot
    result = target.verify(session, len(session.tokens), [5], [certain])
    assert result.length == len(session.tokens) and 0 <= result.num_accepted <= 1
    again, _ = target.prefill(PROMPT, sampling=params)
    target.verify(again, len(again.tokens), [5], [certain])
    assert again.tokens == session.tokens  # same seed, same draws
    with pytest.raises(ValueError, match="unknown verify method"):
        target.prefill(PROMPT, sampling=SamplingParams(temperature=1.0, method="magic"))


@pytest.mark.parametrize("path", ["avx512", "avx2"])
@pytest.mark.parametrize("quantize,dtype", [("int8", "bfloat16"), ("q8_0", "bfloat16"), ("q8_0", "float32"),
                                            ("q4_0", "bfloat16")])
def test_quantized_weights_keep_verification_exact_and_stay_close(models, monkeypatch, quantize, dtype, path):
    """int8 (weights only) and q8_0 (int8 weights and activations per block of 32): a row's logits do
    not depend on how many rows share the call, and stay close to the unquantized model's."""
    _kernel_path(monkeypatch, dtype, quantize if quantize != "int8" else "", path)
    lm = load_model(models["target"], dtype, quantize=quantize)
    assert lm.kernels == f"native {quantize}"
    singles = _one_by_one_equals_verified(lm)
    full = KVSequence(load_model(models["target"], dtype))
    full.forward(PROMPT)
    reference = full.forward(TOKENS)  # [8, vocab] unquantized
    assert not torch.equal(singles, reference)  # the weights did change
    tol = 0.15 if quantize == "q4_0" else 0.05  # 16 levels a block
    assert torch.allclose(singles, reference, atol=tol * float(reference.abs().max()))


def test_int8_needs_the_native_kernels(models):
    with pytest.raises(ValueError, match="needs the native kernels"):
        load_model(models["target"], "bfloat16", native=False, quantize="int8")


def test_releasing_transformers_weights_keeps_the_native_forward(models):
    lm = load_model(models["target"], "bfloat16")
    if lm.native is None:
        pytest.skip("no native kernels on this machine: nothing to release the transformers weights for")
    before = KVSequence(lm)
    expected = before.forward(PROMPT)
    freed = lm.release_transformers_weights()
    layers = sum(p.numel() * p.element_size() for p in lm.model.model.layers.parameters())
    assert freed > 0 and layers == 0  # every layer weight gone, the embedding kept
    assert lm.model.get_input_embeddings().weight.numel() > 0
    assert torch.equal(KVSequence(lm).forward(PROMPT), expected)
