"""Incremental detokenization with stop strings.

Each call emits only the new, *safe* suffix of the output's text: text that
cannot still turn out to be the start of a stop string, and no trailing
incomplete UTF-8 character (decoded as U+FFFD). The stop text itself is not
emitted unless ``include_stop_str`` (vLLM's ``include_stop_str_in_output``).

The output's text is the decode of all its ids, built without decoding them
all on every call (which costs a whole output per token): two offsets into
the ids (vLLM's ``prefix_offset``/``read_offset``, from its
``detokenize_incrementally``) mark the text already fixed; each call decodes
only the ids from ``prefix_offset`` on, and the text they add beyond the decode
of ``[prefix_offset, read_offset)``. Both decodes start at the same token, so
a tokenizer that drops the leading space of a decode's first token drops it
from both. The offsets move on only when the window's text ends in a whole
character and extends the previous window's text; where a tokenizer's decode
is not a prefix-extension (clean-up of spaces before punctuation), that call
decodes all the ids, as before. ``tests/replicas/test_detokenizer.py`` checks
the text equals the whole decode's on random ids.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Args:
        tokenizer: an HF tokenizer (``decode(ids, skip_special_tokens=True)``).
        stop: stop strings (may be empty).
        include_stop_str: keep the matched stop string in the text (cut just after
            it instead of just before it); nothing is held back for stops then.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), include_stop_str: bool = False):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str = include_stop_str
        # a stop string may begin this many characters before the end of the text already emitted
        self._search_back = max((len(s) for s in self.stop), default=1) - 1
        self._holdback = 0 if include_stop_str else self._search_back
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped_on: str | None = None
        self._fixed = ""  # the decode of token_ids[:_read_offset]
        self._prefix_offset = 0
        self._read_offset = 0

    def _decoded(self) -> str:
        """The decode of every id so far (``skip_special_tokens``), from a window of the newest ids."""
        decode, ids = self.tokenizer.decode, self.token_ids
        p, r = self._prefix_offset, self._read_offset
        before = decode(ids[p:r], skip_special_tokens=True) if r > p else ""
        window = decode(ids[p:], skip_special_tokens=True)
        if not window.startswith(before):  # not a prefix-extension here: the whole decode
            full = decode(ids, skip_special_tokens=True)
            if not full.endswith("\ufffd") and len(ids) > r:
                self._fixed, self._prefix_offset, self._read_offset = full, r, len(ids)
            return full
        full = self._fixed + window[len(before):]
        if len(window) > len(before) and not window.endswith("\ufffd"):  # a whole character more: fix it
            self._fixed, self._prefix_offset, self._read_offset = full, r, len(ids)
        return full

    def append(self, token_ids: list[int], final: bool = False, check_stops: bool = True) -> str:
        """Add new token ids; return the text delta that is safe to emit now.

        After a stop string is found, ``stopped_on`` is set, the text is cut
        just before it (just after it with ``include_stop_str``), and further
        calls return "". With ``check_stops=False`` (before ``min_tokens``) stop
        strings are not looked for in this call's text.
        """
        if self.stopped_on is not None:
            return ""
        self.token_ids.extend(token_ids)
        full = self._decoded()
        if self.stop and check_stops:
            start = max(0, len(self.text) - self._search_back)
            hits = [(full.find(s, start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                idx, s = min(hits)
                self.stopped_on = s
                return self._emit(full[: idx + len(s)] if self.include_stop_str else full[:idx])
        if final:
            return self._emit(full)
        safe = full
        if safe.endswith("\ufffd"):
            safe = safe.rstrip("\ufffd")
        if self.stop and self._holdback:
            safe = safe[: max(len(self.text), len(safe) - self._holdback)]
        return self._emit(safe)

    def _emit(self, upto: str) -> str:
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""
        delta = upto[len(self.text):]
        self.text = upto
        return delta
