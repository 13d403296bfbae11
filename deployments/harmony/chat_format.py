"""``chat.completion`` bodies and chunks for harmony models: reasoning, content and tool calls.

Each of the ``n`` choices gets its own :class:`~deployments.harmony.parser.HarmonyOutputParser`,
fed the token ids of every engine chunk of that choice in order (one token on the
standard lane, a quantum on the persistent lane), so both lanes and both response
modes produce the same message:

* ``message.content``: the final channel (and commentary preambles); null when there is none
  (a tool call, or a reply that ended after its reasoning: OpenAI's convention);
* ``message.reasoning_content`` and ``message.reasoning`` (vLLM's field and the newer
  name): the analysis channel, left out with ``include_reasoning: false``;
* ``message.tool_calls``: one entry per valid call, ``finish_reason: "tool_calls"``;
* ``message.harmony_errors`` (only when there are some): what in the model's output
  could not be turned into the above (see the parser), including a reply with no final
  message;
* ``usage.completion_tokens_details.reasoning_tokens``: the analysis channel's tokens.

Streaming: each chunk's delta carries the reasoning / content text it added; a tool call
comes as one delta with its ``index``, ``id``, ``type``, name and whole arguments once its
message has ended (so that what is streamed was checked first). The deltas concatenate
to the non-streaming message.
"""

from __future__ import annotations

from deployments.harmony.parser import Delta, HarmonyOutputParser
from deployments.openai_format import ChatFormat, TokenText, _Choice
from replicas.messages import GenerationChunk


class _HarmonyChoice(_Choice):
    def __init__(self, parser: HarmonyOutputParser):
        super().__init__()
        self.parser = parser
        self.delta = Delta()
        self.calls_sent = 0


class HarmonyChatFormat(ChatFormat):
    """:class:`~deployments.openai_format.ChatFormat` whose messages come from a harmony parser.

    Args:
        model: the served model name.
        tokens: token texts (logprobs).
        logprobs: the request asked for logprobs.
        encoding: openai-harmony's encoding.
        declared_tools: the function names the prompt declared.
        include_reasoning: put the analysis channel in the response.
    """

    def __init__(self, model: str, tokens: TokenText | None, logprobs: bool, encoding,
                 declared_tools: frozenset[str], include_reasoning: bool = True):
        super().__init__(model, tokens, logprobs)
        self.encoding, self.declared, self.include_reasoning = encoding, declared_tools, include_reasoning

    def new_choice(self) -> _HarmonyChoice:
        return _HarmonyChoice(HarmonyOutputParser(self.encoding, self.declared))

    def _update(self, choices, item: GenerationChunk):
        c, part = super()._update(choices, item)
        c.delta = c.parser.feed(item.token_ids)
        if item.finish_reason:
            c.delta.extend(c.parser.finish(item.finish_reason))
            if c.finish == "stop" and c.parser.finish_reason_override:
                c.finish = c.parser.finish_reason_override
        return c, part

    def _message_fields(self, reasoning: str, content: str | None) -> dict:
        out: dict = {"content": content}
        if self.include_reasoning and reasoning:
            out["reasoning_content"] = out["reasoning"] = reasoning
        return out

    def _usage(self, choices: list[_HarmonyChoice], n: int) -> dict:
        """OpenAI's usage plus ``completion_tokens_details.reasoning_tokens``: the analysis-channel text
        tokens of every choice (as the Responses API's ``output_tokens_details``)."""
        usage = ChatFormat._usage(choices, n)
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(c.parser.reasoning_tokens for c in choices)}
        return usage

    def choice(self, i, c: _HarmonyChoice):
        p = c.parser
        message = {"role": "assistant", **self._message_fields(p.reasoning, p.content or None)}
        if p.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in p.tool_calls]
        if p.errors:
            message["harmony_errors"] = list(p.errors)
        return {"index": i, "message": message, "finish_reason": c.finish, "logprobs": c.logprobs}

    def event(self, c: _HarmonyChoice, item: GenerationChunk, finish, part):
        d = c.delta
        delta = {}
        if d.content:
            delta["content"] = d.content
        if self.include_reasoning and d.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = d.reasoning
        if d.tool_calls:
            delta["tool_calls"] = [call.to_openai(index=c.calls_sent + k) for k, call in enumerate(d.tool_calls)]
            c.calls_sent += len(d.tool_calls)
        if item.finish_reason and c.parser.errors:
            delta["harmony_errors"] = list(c.parser.errors)
        finish = c.finish if item.finish_reason else None
        if not delta and not finish and not (part and item.token_ids):
            return None
        return {"index": item.index, "delta": delta, "finish_reason": finish, "logprobs": part}
