import itertools

from gateway.textstream import TextAssembler
from specsplit.api.gateway.v1 import gateway_pb2 as pb


class CharTokenizer:
    """One token per character: id = ord(c)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_eos_ends_and_is_not_included():
    asm = TextAssembler(CharTokenizer(), frozenset({0}))
    delta = asm.add(ids("ab") + [0] + ids("cd"))
    assert (delta.text, delta.token_ids, delta.finish) == ("ab", ids("ab"), pb.FINISH_REASON_EOS)


def test_stop_string_cuts_text_and_tokens_after_it():
    asm = TextAssembler(CharTokenizer(), frozenset(), ("END",))
    first = asm.add(ids("helloE"))
    assert first.text == "hello" and not first.finish  # "E" held back: it may start "END"
    last = asm.add(ids("NDxyz"))
    assert last.finish == pb.FINISH_REASON_STOP_STRING
    assert first.text + last.text == "hello"
    assert asm.token_ids == ids("helloEND")


def test_held_back_text_is_released_when_it_is_not_a_stop():
    asm = TextAssembler(CharTokenizer(), frozenset(), ("END",))
    a = asm.add(ids("xE"))
    b = asm.add(ids("Nq"))
    assert (a.text, b.text) == ("x", "ENq")


def test_limit_flushes_everything():
    asm = TextAssembler(CharTokenizer(), frozenset(), ("END",))
    delta = asm.add(ids("abEN"), pb.FINISH_REASON_LENGTH)
    assert (delta.text, delta.finish) == ("abEN", pb.FINISH_REASON_LENGTH)


def test_stop_string_spanning_rounds_after_emitted_text():
    asm = TextAssembler(CharTokenizer(), frozenset(), ("STOP",))
    out = [asm.add(ids(part)) for part in ["aaaa", "bS", "TO", "Pzz"]]
    assert "".join(d.text for d in out) == "aaaab"
    assert out[-1].finish == pb.FINISH_REASON_STOP_STRING


def test_text_is_the_full_decode_however_tokens_are_grouped():
    """Byte-level BPE with ids that split multi-byte characters: any grouping into rounds gives the
    text a one-shot decode gives, so speculation on and off return the same text."""
    import random

    from conftest import make_tokenizer

    tok = make_tokenizer(300)
    rng = random.Random(0)
    specials = set(tok.all_special_ids)
    for _ in range(30):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        ids = [i for i in ids if i not in specials] or [70]
        cuts = list(itertools.accumulate(rng.randrange(1, 6) for _ in ids))  # pieces of 1-5 tokens
        pieces = [p for p in (ids[a:b] for a, b in zip([0, *cuts], cuts)) if p]
        asm = TextAssembler(tok, frozenset())
        deltas = [asm.add(p, pb.FINISH_REASON_LENGTH if i == len(pieces) - 1 else 0) for i, p in enumerate(pieces)]
        assert "".join(d.text for d in deltas) == tok.decode(ids, skip_special_tokens=True)


def test_incomplete_character_is_held_until_it_completes():
    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    asm = TextAssembler(Bytes(), frozenset())
    snowman = list("☃".encode())  # three bytes
    first = asm.add([ord("a"), snowman[0]])
    second = asm.add(snowman[1:])
    assert (first.text, second.text) == ("a", "☃")
