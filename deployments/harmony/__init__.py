"""GPT-OSS's harmony chat format: the offline vocabulary, prompt rendering and output parsing.

It runs in the ingress, which holds the tokenizer: :mod:`.render` turns chat messages
into prompt token ids, :mod:`.parser` turns the token ids either lane streams back into
reasoning, content and tool calls. docs/harmony.md describes the whole path.
"""

from deployments.harmony.parser import ASSISTANT_STOP_TOKENS, Delta, HarmonyOutputParser, ToolCall
from deployments.harmony.render import (
    EFFORTS,
    FunctionTool,
    HarmonyPrompt,
    RenderError,
    render_chat,
    start_date,
)
from deployments.harmony.vocab import VocabularyError, ensure_vocab_file, harmony_encoding

__all__ = [
    "ASSISTANT_STOP_TOKENS",
    "EFFORTS",
    "Delta",
    "FunctionTool",
    "HarmonyOutputParser",
    "HarmonyPrompt",
    "RenderError",
    "ToolCall",
    "VocabularyError",
    "ensure_vocab_file",
    "harmony_encoding",
    "render_chat",
    "start_date",
]
