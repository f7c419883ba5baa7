"""The bench's anchor runs transformers on the same task our verifier decodes."""

from specsplit.bench.anchor import Anchor, AnchorRecord
from specsplit.model.chat import chat_prompt_ids
from specsplit.model.modeling import load_model
from verify_service.engine import Target


def test_anchor_generates_what_our_target_decodes_greedily(models):
    prompt = "def add(a, b):"
    anchor = Anchor(str(models["target"]), "float32")
    record = AnchorRecord("code")
    anchor.run(record, prompt, 12)
    assert record.tokens["plain"] >= len(record.plain_ids) > 0
    assert [len(record.seconds[m]) for m in ("plain", "lookup")] == [1, 1] and "assisted" not in record.seconds

    lm = load_model(models["target"], "float32")
    target = Target(lm)
    session, result = target.prefill(chat_prompt_ids(lm.tokenizer, [{"role": "user", "content": prompt}]))
    ours = [result.next_token]
    for _ in record.plain_ids[1:]:
        ours.append(target.verify(session, len(session.tokens), []).next_token)
    assert ours == record.plain_ids
    # lookup=plain compares whole outputs, end-of-sequence token included (greedy: reproducible)
    ids = anchor._ids(prompt)
    plain, _ = anchor._generate(ids, 12, "plain")
    lookup, _ = anchor._generate(ids, 12, "lookup")
    assert plain[:len(record.plain_ids)] == record.plain_ids
    assert lookup == plain and record.identical["lookup"]  # greedy prompt lookup decodes what plain decoding does
