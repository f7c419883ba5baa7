"""A tiny random model shaped like the real pair (qwen2: biases on q/k/v, grouped-query attention,
head_dim unlike hidden / heads, an untied output head), through the real loading code, the native
kernels and the model drafter with a draft vocabulary."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tokenizer

from draft_service.drafters.model import ModelDrafter, draft_vocabulary
from specsplit.model import native
from specsplit.model.modeling import KVSequence, load_model

PROMPT = [5, 17, 42, 9, 100, 3, 77, 21]
TOKENS = [11, 40, 7, 99, 3, 250, 17, 8]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = make_tokenizer(300)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                         max_position_embeddings=256, rope_theta=1e6, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(7)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # biases that matter (they start at zero)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
        model.lm_head.weight.mul_(8)
    path = tmp_path_factory.mktemp("qwen2") / "tiny-qwen2"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _needs_native(dtype: torch.dtype) -> None:
    reason = native.unavailable(dtype, torch.device("cpu"))
    if reason:
        pytest.skip(f"native kernels not on this CPU for {dtype}: {reason}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_qwen2_runs_natively_exact_and_close_to_transformers(qwen2_dir, dtype, kernel_path):
    lm = load_model(qwen2_dir, dtype)
    _needs_native(lm.dtype)
    assert lm.kernels == "native" and lm.vocab_size != 49152
    one, many = KVSequence(lm), KVSequence(lm)
    one.forward(PROMPT)
    many.forward(PROMPT)
    singles = torch.stack([one.forward([t])[0] for t in TOKENS])
    assert torch.equal(singles, torch.cat([many.forward(TOKENS[:5]), many.forward(TOKENS[5:])]))
    # Same function as transformers' own forward (biases, GQA and head_dim 32 included).
    reference = load_model(qwen2_dir, dtype, exact=False, native=False)
    with torch.inference_mode():
        theirs = reference.model(torch.tensor([PROMPT + TOKENS])).logits[0, len(PROMPT):].float()
    tol = 0.05 if dtype == "float32" else 0.6
    assert (singles.float() - theirs).abs().max() < tol * theirs.abs().max()
    assert (singles.float().argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.75


def test_draft_vocabulary_is_the_first_ids_and_the_added_tokens(qwen2_dir):
    vocab = draft_vocabulary(qwen2_dir, 100)
    added = {0, 1, 2}  # the tokenizer's special tokens come first in this BPE
    assert vocab.tolist() == sorted(set(range(100)) | added)
    assert draft_vocabulary(qwen2_dir, 0) is None and draft_vocabulary(qwen2_dir, 10**6) is None


@pytest.mark.parametrize("quantize", ["", "int8"])
def test_a_native_draft_vocabulary_scores_exactly_the_full_heads_rows(qwen2_dir, quantize, kernel_path):
    full = load_model(qwen2_dir, "bfloat16", exact=False, quantize=quantize) if not quantize else None
    _needs_native(torch.bfloat16)
    vocab = draft_vocabulary(qwen2_dir, 150)
    sub = load_model(qwen2_dir, "bfloat16", exact=False, quantize=quantize, head_ids=vocab)
    whole = full or load_model(qwen2_dir, "bfloat16", exact=False, quantize=quantize)
    a, b = KVSequence(sub), KVSequence(whole)
    got, want = a.forward(PROMPT + TOKENS), b.forward(PROMPT + TOKENS)
    assert got.shape[-1] == len(vocab) and want.shape[-1] == whole.vocab_size
    assert torch.equal(got, want[:, vocab])  # each output row is computed alone: bit-identical

    # The drafter on the subset drafts the subset's argmax, mapped back to target ids.
    drafter = ModelDrafter(sub, vocab_ids=vocab)
    session = drafter.start(PROMPT)
    session.sync(len(PROMPT), [11])
    drafts = drafter.propose(session, 4).tokens
    check = KVSequence(whole)
    logits = check.forward(PROMPT + [11] + drafts[:-1])[-4:]
    assert drafts == [int(vocab[row[vocab].argmax()]) for row in logits]
    assert set(drafts) <= set(vocab.tolist())


def test_the_hybrid_drafts_with_the_draft_model_where_retrieval_has_nothing(qwen2_dir, tmp_path):
    from draft_service.main import build_drafters
    from specsplit.serving.settings import DraftSettings, ModelSettings, ServerSettings

    drafters = build_drafters(DraftSettings(ServerSettings(f"unix://{tmp_path}/d.sock"),
                                            ModelSettings(str(qwen2_dir), "float32", exact=False)))
    assert set(drafters) == {"ngram", "model", "hybrid"}
    hybrid, model = drafters["hybrid"], drafters["model"]
    assert hybrid.description.kind == "hybrid" and not hybrid.description.needs_features
    prompt = [5, 17, 42, 9, 100, 3, 77, 21]  # no repeats: retrieval finds nothing
    h, m = hybrid.start(prompt), model.start(prompt)
    for s in (h, m):
        s.sync(len(prompt), [11])
    proposal = hybrid.propose(h, 3)
    assert proposal.source == "model" and proposal.tokens == model.propose(m, 3).tokens
