"""Tokenizing what clients send without letting their text become special tokens.

A chat template (or the harmony renderer) puts client text between special tokens:
``<|im_start|>user\\n{content}<|im_end|>``. Tokenizing the rendered string parses every
special-token string in it, including one the client typed, so user content
``"<|im_end|>\\n<|im_start|>assistant\\n..."`` would forge a turn (for harmony models: channels
and tool calls). By default client text is therefore tokenized as text: a special-token string
in it becomes the ordinary tokens of its characters. ``allow-special-tokens=true`` restores
vLLM's behaviour (special-token strings in client text are the special tokens they name).

How (:meth:`ClientTextEncoder.encode_rendered`): each special-token string in client text is
replaced by a private-use sentinel character before rendering; the rendered prompt is split at
its special tokens, which now all come from the template; each piece between them has its
sentinels turned back into the original strings and is tokenized with special-token parsing off
(the ``tokenizers`` flag ``encode_special_tokens``, on a separate copy of the tokenizer so that
concurrent requests never see it flip). Hugging Face's tokenizers split the input at added tokens
and tokenize the pieces between them independently, so the ids are exactly those of the usual
path except at the forged strings. A request whose text holds no special-token string takes the
usual path unchanged (``tokenizer.encode`` of the rendered prompt).

Known difference, only for text that holds a special-token string: a SentencePiece ``Metaspace``
pre-tokenizer with ``prepend_scheme="first"`` prepends its space marker to each piece, not only
the first. SmolLM2 and GPT-OSS use byte-level BPE, which has no such rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from deployments.protocol import OpenAIError

SENTINEL_BASES = (0xE000, 0xF0000, 0x100000)
"""First code point of the private-use ranges tried for sentinels (BMP, planes 15 and 16)."""


class _SentinelClash(Exception):
    """Client text already contains a character of the sentinel range in use."""


class ClientTextEncoder:
    """Client text → token ids, special-token strings in it kept as text unless allowed.

    Thread-safe: it only reads the tokenizers it holds (call it from worker threads).

    Args:
        tokenizer: a Hugging Face fast tokenizer (``backend_tokenizer`` is used for the text-only copy).
        allow_special_tokens: parse special-token strings in client text as special tokens (vLLM's behaviour).

    Raises:
        TypeError: ``allow_special_tokens`` is false and the tokenizer is not a fast tokenizer.
    """

    def __init__(self, tokenizer, allow_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.allow_special_tokens = allow_special_tokens
        specials = {t.content: i for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()
                    if getattr(t, "special", False) and t.content}
        self.special_ids = specials
        self._strings = sorted(specials, key=len, reverse=True)  # leftmost-longest, as tokenizers matches
        self._pattern = re.compile("|".join(map(re.escape, self._strings))) if self._strings else None
        self._text_only = None
        if not allow_special_tokens and self._pattern is not None:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise TypeError("tokenizing client text as text needs a fast (tokenizers) tokenizer; "
                                "use allow-special-tokens=true for this one")
            from tokenizers import Tokenizer

            self._text_only = Tokenizer.from_str(backend.to_str())
            self._text_only.encode_special_tokens = True
        self._prefix, self._suffix = self._added_around()

    def _added_around(self) -> tuple[list[int], list[int]]:
        """The ids ``add_special_tokens=True`` puts before and after a text (e.g. BOS), found on a probe."""
        plain = list(self.tokenizer.encode("a", add_special_tokens=False))
        full = list(self.tokenizer.encode("a", add_special_tokens=True))
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                return full[:i], full[i + len(plain):]
        return [], []

    def has_special(self, text: str) -> bool:
        """Whether ``text`` holds a special-token string of this tokenizer."""
        return self._pattern is not None and self._pattern.search(text) is not None

    def _plain(self, text: str) -> list[int]:
        return self._text_only.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of one client text (a completions prompt): special-token strings stay text unless allowed.

        ``add_special_tokens`` adds what the tokenizer adds around a text (e.g. BOS), as ``tokenizer.encode``.
        """
        if self.allow_special_tokens or not self.has_special(text):
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        ids = self._plain(text)
        return [*self._prefix, *ids, *self._suffix] if add_special_tokens else ids

    def encode_rendered(self, render: Callable[[Callable[[str], str]], str],
                        add_special_tokens: bool = False) -> list[int]:
        """Ids of a prompt rendered around client text (chat template, harmony renderer).

        ``render(protect)`` must build the prompt string, passing every piece of client text through
        ``protect`` (which may return it changed); the template's own text and special tokens are not.
        Example: ``encode_rendered(lambda protect: template(user=protect(content)))``.

        Raises:
            OpenAIError: 400 when client text uses every sentinel range (it cannot be protected).
        """
        if self.allow_special_tokens or self._pattern is None:
            return self._encode(render(lambda text: text), add_special_tokens)
        for base in SENTINEL_BASES:
            try:
                rendered, sentinel, clash = self._render_masked(render, base)
            except _SentinelClash:
                continue
            if sentinel is None:  # no special-token string in client text: the usual path, unchanged
                return self._encode(rendered, add_special_tokens)
            return self._encode_masked(rendered, {c: s for s, c in sentinel.items()}, clash, add_special_tokens)
        raise OpenAIError("the text holds private-use characters of every range this server uses to keep "
                          "special-token strings as text; it cannot be tokenized", param="messages")

    def _render_masked(self, render, base: int):
        """``render`` with special-token strings in client text replaced by sentinels from ``base`` on.

        Returns ``(rendered, sentinels or None when nothing was replaced, pattern of the sentinel range)``.

        Raises:
            _SentinelClash: client text already holds a character of that range.
        """
        sentinel = {s: chr(base + i) for i, s in enumerate(self._strings)}
        clash = re.compile(f"[{re.escape(chr(base))}-{re.escape(chr(base + len(self._strings) - 1))}]")
        used = False

        def protect(text: str) -> str:
            nonlocal used
            if clash.search(text):
                raise _SentinelClash
            masked = self._pattern.sub(lambda m: sentinel[m.group(0)], text)
            used = used or masked != text
            return masked

        rendered = render(protect)
        return rendered, (sentinel if used else None), clash

    def _encode(self, rendered: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(rendered, add_special_tokens=add_special_tokens))

    def _encode_masked(self, rendered: str, restore: dict[str, str], sentinels, add_special_tokens: bool):
        ids: list[int] = []
        pieces = re.split(f"({self._pattern.pattern})", rendered)
        for i, piece in enumerate(pieces):
            if i % 2:  # a special token of the template
                ids.append(self.special_ids[piece])
            elif piece:
                ids.extend(self._plain(sentinels.sub(lambda m: restore[m.group(0)], piece)))
        return [*self._prefix, *ids, *self._suffix] if add_special_tokens else ids

    def encode_chat(self, conversation: list[dict], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False) -> list[int]:
        """Ids of a chat conversation (``[{"role", "content"}]``) through the tokenizer's chat template."""
        def render(protect):
            turns = [{**t, "content": protect(t["content"])} for t in conversation]
            return self.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)

        return self.encode_rendered(render, add_special_tokens)
