"""Incremental detokenization with stop strings.

Each call re-decodes the output ids and emits only the new, *safe* suffix:
text that cannot still turn out to be the start of a stop string, and no
trailing incomplete UTF-8 character (decoded as U+FFFD). The stop text itself
is not emitted unless ``include_stop_str`` (vLLM's ``include_stop_str_in_output``).
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
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
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
