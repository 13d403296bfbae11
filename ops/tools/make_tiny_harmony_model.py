"""A tiny GPT-OSS that speaks harmony: the real o200k harmony vocabulary, overfit on CPU to a handful of answers.

    python -m ops.tools.make_tiny_harmony_model [OUT_DIR]    # default: the cache (built once)

No GPT-OSS weights can be had here, so the harmony path (prompt rendering, the
token-id parser, tools, grammars on the final channel, the Responses API) is tested
end to end with this model: a GPT-OSS checkpoint (MXFP4 experts, sinks, sliding
window, YaRN; :mod:`ops.tools.make_tiny_gpt_oss` writes it) with the 201,088-token
o200k harmony vocabulary, trained to answer :data:`EXAMPLES` in harmony form:
reasoning then a final answer (at each reasoning effort), a tool call, the answer
after the tool's result, and a JSON answer. The prompts are rendered by the same
function the ingress uses (:func:`deployments.harmony.render_chat`) with the
conversation start date :data:`TRAIN_DATE`, so a server deployed with
``harmony_start_date=TRAIN_DATE`` sends exactly the trained prompts.

How it trains fast (well under a minute on 2 cores): the experts stay the frozen
random MXFP4 values written by the maker (so saving loses nothing), the embedding is
frozen, and the LM head is trained only on the tokens the answers use; every other
LM-head row is zero, so at inference every unused token's logit is exactly 0 and
training pushes each right token above 0 (an extra constant-0 class in the loss) and
above the other used tokens. Fixed seed, one thread. The result is then checked with
our own engine (greedy, float32, the saved bf16 weights): it must reproduce every
answer token for token, or training continues (up to :data:`MAX_STEPS`).

The tokenizer is a byte-level BPE ``tokenizer.json`` built from the o200k ranks
(``bpe-openai``) with o200k's pre-tokenizer pattern and harmony's 1,090 special tokens; the
checkpoint ships its own chat template (:data:`CHAT_TEMPLATE`, conversations without tools).

The checkpoint is cached under ``<cache>/tiny-harmony-gpt-oss/<key>`` (the key hashes
this recipe), written under a file lock and published atomically, like the GGUF
conversion in :mod:`replicas.models.loader`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from filelock import FileLock

from deployments.harmony import FunctionTool, harmony_encoding, render_chat
from deployments.harmony.vocab import NUM_MERGEABLE, token_bytes_from_bpe_openai
from replicas import envs

RECIPE_VERSION = 2
"""Bump when anything below changes what is built (it is part of the cache key)."""
TRAIN_DATE = "2025-06-28"
"""The ``Current date:`` of every training prompt (deploy with ``harmony_start_date`` set to it)."""
MAX_STEPS = 1500
STOP_LOSS = 0.01
"""Mean cross-entropy over the answer tokens at which a training round stops (then the engine checks)."""
SEED = 0
LEARNING_RATE = 3e-3
VOCAB_SIZE = 201_088
"""o200k_harmony: 199,998 byte-sequence ranks + 1,090 special tokens (gpt-oss ``vocab_size``)."""
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
"""o200k's pre-tokenizer regex (tiktoken's ``o200k_base`` ``pat_str``)."""
ARCH = {"layers": 4, "experts": 4, "experts_per_token": 2, "hidden": 64, "intermediate": 64, "heads": 8,
        "kv_heads": 2, "head_dim": 16, "sliding_window": 128}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CAPITAL_SCHEMA = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}
CAPITAL_FORMAT = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA, "strict": True}}
QUESTION = "What is the capital of France?"
WEATHER_QUESTION = "What is the weather in Paris?"
CALL_REASONING = "I should call get_weather for Paris."
CALL_ARGUMENTS = '{"city": "Paris"}'
WEATHER_RESULT = '{"temperature_c": 18, "sky": "sunny"}'


@dataclass(frozen=True)
class Example:
    """One trained answer: the chat request's fields and the harmony text the model writes after
    ``<|start|>assistant`` (ending in ``<|return|>`` or ``<|call|>``)."""

    name: str
    messages: list[dict]
    completion: str
    tools: list[dict] | None = None
    reasoning_effort: str | None = None
    response_format: dict | None = None
    extra: dict = field(default_factory=dict)

    def request(self) -> dict:
        """The chat-completions body (without ``model``) that sends this example's prompt."""
        body: dict = {"messages": self.messages, "temperature": 0}
        for key in ("tools", "reasoning_effort", "response_format"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        return body


def _final(reasoning: str, answer: str) -> str:
    return (f"<|channel|>analysis<|message|>{reasoning}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{answer}<|return|>")


EXAMPLES: tuple[Example, ...] = (
    Example("capital", [{"role": "user", "content": QUESTION}],
            _final("The user asks for the capital of France. It is Paris.", "The capital of France is Paris.")),
    Example("capital_low", [{"role": "user", "content": QUESTION}], _final("Paris.", "Paris."),
            reasoning_effort="low"),
    Example("capital_high", [{"role": "user", "content": QUESTION}],
            _final("The user wants the capital city of France. France's capital and largest city is Paris, "
                   "on the Seine. Answer in one sentence.", "The capital of France is Paris, on the Seine."),
            reasoning_effort="high"),
    Example("weather_call", [{"role": "user", "content": WEATHER_QUESTION}],
            f"<|channel|>analysis<|message|>{CALL_REASONING}<|end|><|start|>assistant to=functions.get_weather"
            f"<|channel|>commentary <|constrain|>json<|message|>{CALL_ARGUMENTS}<|call|>",
            tools=[WEATHER_TOOL]),
    Example("weather_answer", [
        {"role": "user", "content": WEATHER_QUESTION},
        {"role": "assistant", "content": None, "reasoning_content": CALL_REASONING, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": WEATHER_RESULT}],
        _final("The tool says 18 C and sunny.", "It is 18 °C and sunny in Paris."), tools=[WEATHER_TOOL]),
    Example("capital_json", [{"role": "user", "content": "Name the capital of France as JSON."}],
            _final("Return JSON with the country and its capital.", '{"country": "France", "capital": "Paris"}'),
            response_format=CAPITAL_FORMAT),
)
"""What the model answers (tests send exactly these requests)."""


CHAT_TEMPLATE = r'''{#- Harmony (GPT-OSS) prompts for conversations without tools, written for persistent-serve's tiny
    harmony model: the same ids as deployments/harmony/render.py. -#}
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else "medium" -%}
{%- set date = conversation_start_date if conversation_start_date is defined else strftime_now("%Y-%m-%d") -%}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n" -}}
{%- if date -%}{{- "Current date: " + date + "\n" -}}{%- endif -%}
{{- "\nReasoning: " + effort + "\n\n# Valid channels: analysis, final. Channel must be included for every message.<|end|>" -}}
{%- set ns = namespace(instructions="", last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role in ("system", "developer") and m.content -%}
    {%- set ns.instructions = ns.instructions + ("\n\n" if ns.instructions else "") + m.content -%}
  {%- endif -%}
  {%- if m.role == "user" -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if ns.instructions -%}
<|start|>developer<|message|># Instructions

{{ ns.instructions }}<|end|>
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == "user" -%}
<|start|>user<|message|>{{ m.content }}<|end|>
  {%- elif m.role == "assistant" -%}
    {%- if loop.index0 > ns.last_user and m.reasoning_content -%}
<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>
    {%- endif -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}'''
"""The checkpoint's own ``chat_template.jinja``: harmony for conversations without tools (system,
developer, user, assistant turns), the same ids as :func:`deployments.harmony.render_chat`; the
ingress checks that at load (``/debug/stats`` ``ingress.checkpoint_chat_template``)."""


def example_prompt(ex: Example, encoding=None) -> list[int]:
    """The prompt ids the ingress renders for ``ex`` (start date :data:`TRAIN_DATE`)."""
    tools = [FunctionTool(t["function"]["name"], t["function"].get("description", ""), t["function"].get("parameters"))
             for t in ex.tools or ()]
    fmt = None
    if ex.response_format and ex.response_format.get("type") == "json_schema":
        js = ex.response_format["json_schema"]
        fmt = (js["name"], js["schema"], js.get("description"))
    return render_chat(ex.messages, tools=tools, reasoning_effort=ex.reasoning_effort,
                       conversation_start_date=TRAIN_DATE, response_format=fmt, encoding=encoding).token_ids


def example_completion(ex: Example, encoding=None) -> list[int]:
    enc = encoding or harmony_encoding()
    return list(enc.encode(ex.completion, allowed_special="all"))


# ------------------------------------------------------------------------------------------- tokenizer
def _byte_encoder() -> dict[int, str]:
    from deployments.openai_format import _byte_decoder

    return {b: ch for ch, b in _byte_decoder().items()}


def write_harmony_tokenizer(out_dir: Path) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` of the o200k harmony vocabulary into ``out_dir``.

    Merges are recovered from the ranks (for each token, every split into two lower-rank tokens,
    ordered by rank), the usual tiktoken → byte-level BPE conversion.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ranks = token_bytes_from_bpe_openai()
    index = {b: r for r, b in enumerate(ranks)}
    enc_b = _byte_encoder()

    def spell(b: bytes) -> str:
        return "".join(enc_b[x] for x in b)

    vocab = {spell(b): r for r, b in enumerate(ranks)}
    merges = []
    for r, b in enumerate(ranks):
        splits = [(index[b[:i]], index[b[i:]]) for i in range(1, len(b)) if b[:i] in index and b[i:] in index]
        merges.extend((r, lo, hi) for lo, hi in sorted(splits))
    merges.sort(key=lambda m: m[0])
    tok = Tokenizer(models.BPE(vocab, [(spell(ranks[lo]), spell(ranks[hi])) for _, lo, hi in merges],
                               fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    enc = harmony_encoding()
    specials = [enc.decode([i]) for i in range(NUM_MERGEABLE, VOCAB_SIZE)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|return|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(out_dir)


# ------------------------------------------------------------------------------------------- training
def _cache_key() -> str:
    spec = json.dumps({"v": RECIPE_VERSION, "arch": ARCH, "date": TRAIN_DATE, "seed": SEED,
                       "examples": [[e.name, e.messages, e.completion, e.tools, e.reasoning_effort,
                                     e.response_format] for e in EXAMPLES]}, sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def default_dir() -> Path:
    return envs.cache_dir() / "tiny-harmony-gpt-oss" / _cache_key()


def _shrink_experts(path: Path, seed: int) -> None:
    """Re-draw the experts' down projections small (std 0.2/sqrt(I)), so the frozen random experts
    add little noise to the residual stream; stored MXFP4, so training sees exactly what is saved."""
    from safetensors.torch import load_file, save_file

    from replicas.kernels.moe.mxfp4 import quantize_mxfp4

    gen = torch.Generator().manual_seed(seed + 1)
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("down_proj_blocks")]:
        base = name.removesuffix("_blocks")
        e, rows, nblk, _ = tensors[name].shape
        cols = nblk * 32
        tensors[name], tensors[base + "_scales"] = quantize_mxfp4(
            torch.randn((e, rows, cols), generator=gen) * (0.2 / cols ** 0.5))
        tensors[base + "_bias"] = torch.zeros_like(tensors[base + "_bias"])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt", "source": "ops.tools.make_tiny_harmony_model"})


def _data(enc) -> tuple[list[list[int]], list[int], list[int]]:
    """Sequences (prompt + completion), each one's prompt length, and the sorted answer-token set."""
    seqs, starts, used = [], [], set()
    for ex in EXAMPLES:
        p, c = example_prompt(ex, enc), example_completion(ex, enc)
        seqs.append(p + c)
        starts.append(len(p))
        used.update(c)
    return seqs, starts, sorted(used)


def _train(hf, seqs, starts, used, steps: int, log, head: torch.Tensor | None = None,
           stop_loss: float = STOP_LOSS) -> tuple[torch.Tensor, int]:
    """Train in place for up to ``steps`` steps (fewer once the loss is below ``stop_loss``);
    returns the LM-head rows of ``used`` (``[len(used), hidden]``, continuing ``head`` if given) and
    the steps run."""
    hidden = hf.config.hidden_size
    for name, p in hf.named_parameters():
        p.requires_grad = not (name.startswith("lm_head") or name.endswith("embed_tokens.weight")
                               or name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"))
    head = torch.nn.Parameter(head.clone() if head is not None else torch.randn(len(used), hidden) * 0.02)
    col = {t: i for i, t in enumerate(used)}
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    targets = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, st) in enumerate(zip(seqs, starts, strict=True)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
        for pos in range(st - 1, len(s) - 1):
            targets[i, pos] = col[s[pos + 1]]
    params = [p for p in hf.parameters() if p.requires_grad] + [head]
    opt = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0)
    zero = torch.zeros(1)
    keep = targets >= 0
    hf.train()
    step = 0
    for step in range(steps):
        h = hf.model(input_ids=ids, attention_mask=mask).last_hidden_state[keep]  # [N, hidden]
        logits = torch.cat([h @ head.T, zero.expand(h.shape[0], 1)], dim=1)  # [N, |used| + 1]
        loss = torch.nn.functional.cross_entropy(logits, targets[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log and step % 50 == 0:
            log(f"step {step} loss {loss.item():.4f}")
        if loss.item() < stop_loss:
            break
    hf.eval()
    return head.detach(), step + 1


def _save(hf, head: torch.Tensor, used: list[int], path: Path) -> None:
    """Write the trained non-expert tensors (bf16) into ``path``'s safetensors; experts stay as written."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    state = hf.state_dict()
    for name in list(tensors):
        if name.endswith(("_blocks", "_scales")) or name == "lm_head.weight":
            continue
        tensors[name] = state[name].detach().to(torch.bfloat16).contiguous()
    lm = torch.zeros(VOCAB_SIZE, hf.config.hidden_size)
    lm[torch.tensor(used)] = head
    tensors["lm_head.weight"] = lm.to(torch.bfloat16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt", "source": "ops.tools.make_tiny_harmony_model"})


def check_answers(path: Path, encoding=None) -> list[str]:
    """Greedy answers of our engine (float32, CPU) over ``path``; returns the names of the examples it
    does not reproduce token for token (empty when every answer is right)."""
    from replicas.config import EngineConfig
    from replicas.engine import EngineCore, LLMEngine
    from replicas.request import SamplingParams

    enc = encoding or harmony_encoding()
    core = EngineCore.load(EngineConfig(model=str(path), dtype="float32", device="cpu", max_model_len=512,
                                        num_kv_blocks=128, progress=False))
    engine = LLMEngine(core)
    want = {}
    for ex in EXAMPLES:
        c = example_completion(ex, enc)
        want[ex.name] = c
        engine.add_request(ex.name, example_prompt(ex, enc),
                           SamplingParams(max_tokens=len(c) + 2, temperature=0.0, stop_token_ids=(200002, 200012)))
    got: dict[str, list[int]] = {ex.name: [] for ex in EXAMPLES}
    while engine.has_unfinished():
        for chunk in engine.step():
            got[chunk.request_id].extend(chunk.token_ids)
    return [name for name in want if got[name] != want[name]]


def build(out_dir: Path, log=print) -> Path:
    """Make, train and check the model in ``out_dir`` (created). Returns it.

    Raises:
        RuntimeError: after :data:`MAX_STEPS` the engine still does not reproduce every answer.
    """
    from transformers import GptOssForCausalLM, Mxfp4Config

    from ops.tools.make_tiny_gpt_oss import make_tiny_gpt_oss

    t0 = time.monotonic()
    torch.manual_seed(SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reductions on every machine
    try:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tok_dir = Path(tempfile.mkdtemp(prefix="harmony-tokenizer-"))
        try:
            write_harmony_tokenizer(tok_dir)
            make_tiny_gpt_oss(out_dir, **ARCH, max_position_embeddings=4096, seed=SEED, tokenizer_source=tok_dir)
        finally:
            shutil.rmtree(tok_dir, ignore_errors=True)
        # the released checkpoints' special-token ids (the maker copies them from the tokenizer)
        cfg = json.loads((out_dir / "config.json").read_text())
        cfg.update(bos_token_id=199998, eos_token_id=200002, pad_token_id=199999)
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (out_dir / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012], "pad_token_id": 199999}, indent=2) + "\n")
        (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")
        _shrink_experts(out_dir, SEED)
        log(f"checkpoint written ({time.monotonic() - t0:.0f} s)")
        enc = harmony_encoding()
        seqs, starts, used = _data(enc)
        hf = GptOssForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                               quantization_config=Mxfp4Config(dequantize=True))
        steps, wrong, head = 0, ["all"], None
        while wrong and steps < MAX_STEPS:
            first = steps == 0  # later rounds (the engine disagreed) run their 100 steps in full
            head, ran = _train(hf, seqs, starts, used, 200 if first else 100, log, head, STOP_LOSS if first else 0.0)
            steps += ran
            log(f"trained ({time.monotonic() - t0:.0f} s)")
            _save(hf, head, used, out_dir)
            wrong = check_answers(out_dir, enc)
            log(f"after {steps} steps ({time.monotonic() - t0:.0f} s): wrong answers {wrong or 'none'}")
        if wrong:
            raise RuntimeError(f"the tiny harmony model does not reproduce {wrong} after {steps} steps")
        return out_dir
    finally:
        torch.set_num_threads(threads)


def tiny_harmony_model(out_dir: str | Path | None = None, log=None) -> Path:
    """The cached trained checkpoint (built once: under a file lock, published atomically)."""
    target = Path(out_dir) if out_dir else default_dir()
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "model.safetensors").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
        try:
            build(tmp, log=log or (lambda _msg: None))
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m ops.tools.make_tiny_harmony_model",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=None, help="default: the cache")
    a = parser.parse_args(argv)
    out = tiny_harmony_model(a.out_dir, log=print)
    print(out)
    return out


if __name__ == "__main__":
    main()
