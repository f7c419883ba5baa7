"""Turns committed token ids into text: end-of-sequence, stop strings and streaming hold-back.

Tokens are detokenized one at a time over a short window (TGI's prefix/read offsets), so a round
costs O(tokens in the round), not O(tokens so far), and the text is the same however the tokens
were grouped into rounds: speculation on and off produce the same text for the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.api.gateway.v1 import gateway_pb2 as pb


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
    _prefix: int = 0  # token_ids[_prefix:_read] is the context the next token's text is diffed against
    _read: int = 0
    _emitted: int = 0  # characters of `text` already handed out

    def add(self, new_ids: list[int], limit: int = pb.FINISH_REASON_UNSPECIFIED) -> Delta:
        """Appends committed tokens until one finishes the text; returns what is new and safe to
        show. `limit` is the finish reason to report if the tokens end the request (length or
        context) without an end-of-sequence token or stop string of their own."""
        added: list[int] = []
        for token in new_ids:
            if token in self.eos_ids:
                return self._finish(added, pb.FINISH_REASON_EOS)
            self.token_ids.append(token)
            added.append(token)
            searched_from = len(self.text)
            self._detokenize()
            cut = self._stop_index(searched_from)
            if cut is not None:
                self.text = self.text[:cut]
                return self._delta(added, pb.FINISH_REASON_STOP_STRING)
        if limit:
            return self._finish(added, limit)
        return self._delta(added, pb.FINISH_REASON_UNSPECIFIED)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)

    def _detokenize(self) -> None:
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix)
        # U+FFFD at the end: the token ends inside a multi-byte character; wait for the rest.
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.token_ids)

    def _finish(self, added: list[int], reason: int) -> Delta:
        """Flushes tokens still waiting for the rest of a character (as U+FFFD, like decode())."""
        if self._read < len(self.token_ids):
            self.text += self._decode(self._prefix)[len(self._decode(self._prefix, self._read)):]
            self._prefix = self._read = len(self.token_ids)
            cut = self._stop_index(self._emitted)
            if cut is not None:
                self.text = self.text[:cut]
                reason = pb.FINISH_REASON_STOP_STRING
        return self._delta(added, reason)

    def _stop_index(self, searched_from: int) -> int | None:
        """First stop string that ends in the text added since `searched_from`."""
        if not self.stop_strings:
            return None
        window = max(0, searched_from - max(map(len, self.stop_strings)) + 1)
        hits = [i for s in self.stop_strings if (i := self.text.find(s, window)) >= 0]
        return min(hits) if hits else None

    def _delta(self, added: list[int], finish: int) -> Delta:
        end = len(self.text) if finish else len(self.text) - self._holdback()
        end = max(end, self._emitted)
        delta = Delta(self.text[self._emitted:end], added, finish)
        self._emitted = end
        return delta

    def _holdback(self) -> int:
        """Characters at the end that may be the start of a stop string."""
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
