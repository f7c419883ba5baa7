from gateway.textstream import TextAssembler
from specsplit.gateway.v1 import gateway_pb2 as pb


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
