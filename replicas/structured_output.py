"""Structured outputs: a JSON schema (or any JSON object) as a token mask for the sampler.

The grammar engine is ``llguidance`` (its CPU wheel has no dependencies): the schema
compiles to a grammar, and a matcher per sequence gives the tokens allowed next, as a
bitmask over the vocabulary, and advances on each sampled token. When the grammar is
complete only the end-of-sequence token is allowed, so the sequence ends there.

A grammar may also start later: :attr:`StructuredOutput.start_after` names token ids
after which the mask starts (it is off until the output ends with them, then the
matcher starts from the next token). Harmony models (GPT-OSS) do not use it: their
``response_format`` grammar is a Lark grammar over the whole reply, optional reasoning
then the final answer (:func:`deployments.harmony.render.final_answer_grammar`), so a
reply cannot end before its answer.

The interface the engine uses is two methods of :class:`TokenConstraint`:
``allowed(vocab)`` before sampling and ``accept(token)`` after.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

JSON_OBJECT_SCHEMA = {"type": "object"}
"""``response_format: json_object``: any JSON object."""


class GrammarError(ValueError):
    """A schema the grammar engine cannot compile (the message says why)."""


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    Attributes:
        schema: the JSON schema, as JSON text (``{"type": "object"}`` for json_object).
        start_after: token ids after which the constraint starts (empty: from the first token).
        lark: an llguidance Lark grammar to use instead of ``schema`` (special tokens by name, JSON
            schemas inline as ``%json {...}``), e.g. a harmony tool call that must be made.
    """

    schema: str = ""
    start_after: tuple[int, ...] = ()
    lark: str | None = None

    def grammar(self) -> str:
        """The llguidance grammar of :attr:`schema` (or :attr:`lark` as it is).

        Raises:
            GrammarError: the schema is not valid JSON or cannot be compiled.
        """
        from llguidance import LLMatcher

        if self.lark is not None:
            return self.lark
        try:
            grammar = LLMatcher.grammar_from_json_schema(self.schema)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from exc
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise GrammarError(f"the JSON schema cannot be compiled: {error}")
        return grammar


def structured_output(schema: dict | None, start_after: tuple[int, ...] = ()) -> StructuredOutput:
    """A :class:`StructuredOutput` for ``schema`` (None: any JSON object), checked to compile.

    Raises:
        GrammarError: the schema cannot be compiled.
    """
    spec = StructuredOutput(json.dumps(JSON_OBJECT_SCHEMA if schema is None else schema),  # key order matters
                            tuple(start_after))
    spec.grammar()
    return spec


class GrammarCompiler:
    """One per engine: the tokenizer in llguidance's form (built once, ~1 s for a 200k vocabulary).

    Args:
        tokenizer: the model's fast HF tokenizer.
        eos_token_id: the token allowed once the grammar is complete (the tokenizer's EOS by default).
    """

    def __init__(self, tokenizer, eos_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self._ll = None
        self._lock = threading.Lock()

    def _lltokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=self.eos_token_id)
            return self._ll

    def warm(self) -> None:
        """Build llguidance's tokenizer now (the standard lane's engine actor does it in a background
        thread at start, so the first structured request does not wait for it). Never raises: a
        failure is raised again, as :class:`GrammarError`, by the first :meth:`constraint`."""
        try:
            self._lltokenizer()
        except Exception:  # noqa: BLE001 - reported per request by constraint()
            logger.warning("structured outputs unavailable: llguidance cannot read this tokenizer", exc_info=True)

    def constraint(self, spec: StructuredOutput) -> TokenConstraint:
        """A fresh matcher for one sequence.

        Raises:
            GrammarError: the grammar cannot be compiled, or llguidance cannot read the tokenizer.
        """
        try:
            return TokenConstraint(self, spec)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer llguidance cannot convert
            raise GrammarError(f"structured outputs are not available for this model: {exc}") from exc


class TokenConstraint:
    """The mask of one sequence's grammar (see the module docstring).

    Attributes:
        active: the grammar applies now (``start_after`` seen, or none given).
        error: llguidance's error once the matcher failed (the mask is then off), else None.
    """

    def __init__(self, compiler: GrammarCompiler, spec: StructuredOutput):
        from llguidance import LLMatcher

        self.compiler, self.spec = compiler, spec
        self._grammar = spec.grammar()
        self._matcher_cls = LLMatcher
        self._matcher = None
        self._recent: list[int] = []
        self.active = not spec.start_after
        self.error: str | None = None
        if self.active:
            self._start()

    def _start(self) -> None:
        self._matcher = self._matcher_cls(self.compiler._lltokenizer(), self._grammar, log_level=0)
        if self._matcher.is_error():
            self.error, self.active = self._matcher.get_error(), False

    def allowed(self, vocab_size: int, device="cpu"):
        """Bool tensor ``[vocab_size]`` on ``device``: True where a token may come next; None when the mask is off."""
        import numpy as np
        import torch

        if not self.active or self._matcher is None:
            return None
        # llguidance's bitmask: bit (i % 32) of little-endian 32-bit word i // 32 is token i
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if bits.size < vocab_size:  # model vocabularies may be padded past the tokenizer's
            bits = np.concatenate([bits, np.zeros(vocab_size - bits.size, dtype=np.uint8)])
        bits = bits[:vocab_size]
        if not bits.any():
            self.error, self.active = "the grammar allows no token", False
            return None
        return torch.from_numpy(bits.astype(np.bool_)).to(device)

    def accept(self, token: int) -> None:
        """Advance on the sampled ``token`` (and start the grammar after ``start_after``)."""
        if self.active and self._matcher is not None:
            if not self._matcher.consume_token(int(token)):
                self.error, self.active = self._matcher.get_error() or f"token {token} rejected", False
            return
        if self.error is not None or not self.spec.start_after:
            return
        n = len(self.spec.start_after)
        self._recent = (self._recent + [int(token)])[-n:]
        if tuple(self._recent) == self.spec.start_after:
            self.active = True
            self._start()
