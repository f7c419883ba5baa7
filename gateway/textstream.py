"""Turns committed token ids into text: end-of-sequence, stop strings and streaming hold-back."""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.gateway.v1 import gateway_pb2 as pb


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish: int = pb.FINISH_REASON_UNSPECIFIED


@dataclass
class TextAssembler:
    tokenizer: object
    eos_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    _emitted: int = 0  # characters of `text` already handed out

    def add(self, new_ids: list[int], limit: int = pb.FINISH_REASON_UNSPECIFIED) -> Delta:
        """Appends committed tokens until one finishes the text; returns what is new and safe to
        show. `limit` is the finish reason to report if the tokens end the request (length or
        context) without an end-of-sequence token or stop string of their own."""
        added: list[int] = []
        finish = pb.FINISH_REASON_UNSPECIFIED
        for token in new_ids:
            if token in self.eos_ids:
                finish = pb.FINISH_REASON_EOS
                break
            self.token_ids.append(token)
            added.append(token)
            if self.stop_strings:
                cut = self._stop_index(self._decode())
                if cut is not None:
                    self.text = self._decode()[:cut]
                    return self._delta(added, pb.FINISH_REASON_STOP_STRING)
        self.text = self._decode()
        return self._delta(added, finish or limit)

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _stop_index(self, text: str) -> int | None:
        # Only the tail can hold a new match: search from before the last emitted stretch.
        window = max(0, self._emitted - max(map(len, self.stop_strings)))
        hits = [i for s in self.stop_strings if (i := text.find(s, window)) >= 0]
        return min(hits) if hits else None

    def _delta(self, added: list[int], finish: int) -> Delta:
        end = len(self.text) if finish else len(self.text) - self._holdback()
        end = max(end, self._emitted)
        delta = Delta(self.text[self._emitted:end], added, finish)
        self._emitted = end
        return delta

    def _holdback(self) -> int:
        """Characters at the end that must wait: a possible start of a stop string, or an
        incomplete multi-byte character (decoded as U+FFFD)."""
        text = self.text
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
