"""The bench's anchor runs transformers on the same task our verifier decodes."""

from specsplit.modeling import chat_prompt_ids, load_model
from specsplit.tools.anchor import Anchor, AnchorRecord
from verify_service.engine import Target


def test_anchor_generates_what_our_target_decodes_greedily(models):
    prompt = "def add(a, b):"
    anchor = Anchor(str(models["target"]), "float32")
    record = AnchorRecord("code")
    anchor.run(record, prompt, 12)
    assert record.plain_tokens >= len(record.plain_ids) > 0 and len(record.plain_s) == len(record.lookup_s) == 1

    lm = load_model(models["target"], "float32")
    target = Target(lm)
    session, result = target.prefill(chat_prompt_ids(lm.tokenizer, [{"role": "user", "content": prompt}]))
    ours = [result.next_token]
    while len(ours) < len(record.plain_ids):
        ours.append(target.verify(session, len(session.tokens), []).next_token)
    assert ours == record.plain_ids
    # lookup=plain compares whole outputs, end-of-sequence token included (greedy: reproducible)
    ids = anchor._ids(prompt)
    plain, _ = anchor._generate(ids, 12, lookup=False)
    lookup, _ = anchor._generate(ids, 12, lookup=True)
    assert record.lookup_identical == (plain == lookup) and plain[:len(record.plain_ids)] == record.plain_ids
