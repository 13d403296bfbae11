"""Shared fixtures for ``tests/replicas``: the real SmolLM2 engine and the transformers reference.

Everything heavy is loaded once per session: our :class:`EngineCore` (``core``),
the transformers reference model (``hf_model``) and its tokenizer. Greedy
reference continuations are memoised per (prompt, length, eos mode).

Page accounting is an invariant (docs/design.md "KV cache geometry"): after every
test that used ``core``, the autouse fixture checks that the KV page pool is
back to full.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine import EngineCore, LLMEngine
from replicas.messages import GenerateRequest, GenerationChunk
from replicas.models.loader import resolve_model
from replicas.request import SamplingParams

MODEL = "smollm2-135m-instruct"

PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in one sentence what a CPU does.",
    "How many legs does a spider have?",
)
"""Five chat prompts used by the equivalence tests."""

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
"""40 greedy tokens, EOS ignored: every lane produces exactly 40 tokens."""


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn, chat template applied, ready for the assistant."""
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(enc["input_ids"])


def assert_pool_full(core: EngineCore) -> None:
    """After every request the KV page pool is back to full."""
    a = core.allocator
    assert a.num_free == a.num_blocks, f"KV page leak: {a.num_blocks - a.num_free} of {a.num_blocks} pages still held"


def run_standard(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], max_steps: int = 10_000
) -> dict[str, list[GenerationChunk]]:
    """Add every request to ``engine``, step until done, return each request's chunks in order, with their
    text made as the served path's reader makes it (``replicas.output_processor``): a request that a stop
    string ended is aborted in the engine then, as closing its stream does. Chunks of requests added to
    ``engine`` before the call come back as the engine made them (token ids, no text)."""
    from replicas.output_processor import OutputProcessor

    processors = {}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
        processors[rid] = OutputProcessor(engine.core.tokenizer, params)
    chunks: dict[str, list[GenerationChunk]] = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for c in engine.step():
            processor = processors.get(c.request_id)
            if processor is None:
                chunks[c.request_id].append(c)
                continue
            if processor.finished:
                continue
            shown = processor.process(c)
            if shown is not None:
                chunks[c.request_id].append(shown)
            if processor.finished and processor.engine_busy:
                engine.abort(c.request_id)
    else:
        raise AssertionError(f"engine did not finish within {max_steps} steps")
    return dict(chunks)


def tokens_of(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def text_of(chunks: list[GenerationChunk]) -> str:
    return "".join(c.text for c in chunks)


def greedy_request(request_id: str, ids: list[int], params: SamplingParams = GREEDY, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=list(ids), params=params, **kw)


def staged_columns(column: list[int], tables: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``column`` (positions or context lengths) and ``tables`` ``[B, width]`` as strided views of one
    ``[B, 2 + width]`` int64 buffer, laid out as :mod:`replicas.decode_graphs` stages a batch (token,
    position, block table), so kernels must honour the strides."""
    staging = torch.zeros(tables.shape[0], 2 + tables.shape[1], dtype=torch.long)
    staging[:, 1] = torch.tensor(column)
    staging[:, 2:] = tables
    staging = staging.to(device)
    assert staging[:, 1].stride(0) != 1
    return staging[:, 1], staging[:, 2:]


def small_core(core: EngineCore, num_kv_blocks: int, max_model_len: int, prefix_caching: bool = False) -> EngineCore:
    """A real engine core with its own (small) KV cache, sharing ``core``'s loaded weights: built by
    :meth:`EngineCore.build` (the one constructor), without re-reading the checkpoint."""
    cfg = core.config.model_copy(update={"num_kv_blocks": num_kv_blocks, "max_model_len": max_model_len})
    EngineConfig.model_validate(cfg.model_dump())  # the same cross-field checks as a fresh config
    return EngineCore.build(cfg, core.model, core.tokenizer, enable_prefix_caching=prefix_caching,
                            eos_token_ids=core.eos_token_ids)


TORCH_THREADS = 1
"""One intra-op thread: on a shared 2-core machine, torch's default 2 OpenMP threads spin against
other processes and a decode step slows down up to 30x; one thread keeps the suite's time stable."""


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    """Run this folder's tests (our engine and the transformers reference) on TORCH_THREADS threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def core() -> EngineCore:
    """The replica engine core (SmolLM2-135M-Instruct, fp32 on CPU), loaded once."""
    return EngineCore.load(EngineConfig(model=MODEL, progress=False, torch_threads=TORCH_THREADS))


@pytest.fixture(scope="session")
def tokenizer():
    """transformers' tokenizer of the reference checkpoint."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(MODEL, progress=False))


@pytest.fixture(scope="session")
def hf_model():
    """transformers' ``LlamaForCausalLM`` over the same converted checkpoint, fp32 (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL, progress=False), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """``hf_greedy(ids, max_new_tokens, ignore_eos)`` -> new token ids from ``generate(do_sample=False)``.

    With ``ignore_eos`` the reference runs without an EOS id (it never stops
    early); otherwise it stops at (and includes) the model's EOS token.
    """
    cache: dict[tuple, list[int]] = {}

    def run(ids: list[int], max_new_tokens: int, ignore_eos: bool) -> list[int]:
        key = (tuple(ids), max_new_tokens, ignore_eos)
        if key not in cache:
            x = torch.tensor([ids])
            kw = {"eos_token_id": None} if ignore_eos else {}
            with torch.inference_mode():
                out = hf_model.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                    pad_token_id=hf_model.generation_config.pad_token_id, **kw,
                )
            cache[key] = out[0, len(ids):].tolist()
        return list(cache[key])

    return run


@pytest.fixture(autouse=True)
def _kv_pool_full_after_test(request):
    """Every test that used the session ``core`` must leave its KV page pool full."""
    yield
    if "core" in request.fixturenames:
        assert_pool_full(request.getfixturevalue("core"))
