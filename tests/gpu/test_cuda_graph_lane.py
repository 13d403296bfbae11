"""On an NVIDIA GPU: the persistent lane's captured CUDA-graph quanta against the standard lane.

Run through the ``device`` tool: ``python -m pytest tests/gpu -q -o addopts=""``. The standard lane
decodes through its per-batch-size CUDA graphs (:mod:`replicas.decode_graphs`) here.
Models: SmolLM2-135M's shape with random weights, SmolLM2-135M-Instruct's real
weights when ``SMOLLM2_PATH`` names its GGUF file (or HF directory), and a
small random GPT-OSS (MXFP4 experts, sinks, sliding window). fp32, so that the
two lanes' different kernels (Triton decode kernels vs the standard lane's
paged attention and dequantized experts) agree to ~1e-6 and greedy near-ties
do not decide the test.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.conftest import dummy_core

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

SMALL_GPT_OSS = {
    "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 16, "vocab_size": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "pad_token_id": 0, "eos_token_id": 1,
}


def _lanes_agree(core, vocab: int, prompts_n: int = 20, tokens: int = 128, standard_graphs: bool = True,
                 max_num_seqs: int | None = None) -> None:
    from replicas.engine import LLMEngine
    from replicas.messages import GenerateRequest
    from replicas.persistent.factory import create_backend
    from replicas.persistent.lane import PersistentLane
    from replicas.request import SamplingParams
    from replicas.scheduler import SchedulerConfig

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(20, 300, (prompts_n,), generator=g)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    cfg = core.config
    engine = LLMEngine(core, SchedulerConfig(max_num_seqs or cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                             cfg.enable_chunked_prefill))
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    standard: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for c in engine.step():
            standard[c.request_id] += c.token_ids
    assert core.allocator.num_free == core.allocator.num_blocks

    backend = create_backend("cuda_graph", core)
    lane = PersistentLane(core, backend)
    assert backend.use_graphs and len(backend._graphs) == 8
    same = 0
    for i, p in enumerate(prompts):
        chunks = list(lane.generate(GenerateRequest(f"p{i}", p, params)))
        out = [t for c in chunks for t in c.token_ids]
        assert [len(c.token_ids) for c in chunks] == [1] + [8] * ((tokens - 1) // 8) + (
            [(tokens - 1) % 8] if (tokens - 1) % 8 else [])
        same += out == standard[f"s{i}"]
    assert core.allocator.num_free == core.allocator.num_blocks
    assert same == len(prompts), f"{same}/{len(prompts)} prompts identical"
    if standard_graphs:
        graphs = core.runner.graphs
        assert graphs is not None and graphs.replays > 0 and graphs._graphs, "standard lane decoded without graphs"


def test_smollm2_shape_random_weights_20_prompts_x_128_tokens():
    core = dummy_core("smollm2-135m", torch.float32, max_model_len=512)
    core.model.lm_head.weight.data.mul_(20)  # spread the random logits: wide argmax margins
    _lanes_agree(core, 49152)


@pytest.mark.skipif(not os.environ.get("SMOLLM2_PATH"), reason="set SMOLLM2_PATH to the SmolLM2 GGUF or HF dir")
def test_smollm2_real_weights_20_prompts_x_128_tokens():
    from replicas.config import EngineConfig
    from replicas.engine import EngineCore

    core = EngineCore.load(EngineConfig(model=os.environ["SMOLLM2_PATH"], device="cuda", dtype="float32",
                                        max_model_len=512, num_kv_blocks=72, enable_prefix_caching=False,
                                        progress=False))
    _lanes_agree(core, 49152)


GPT_OSS_PAGES = 20 * -(-(300 + 128) // 16) + 8
"""KV pages for the 20 prompts (up to 300 tokens, 128 new) decoding all at once: with ``dummy_core``'s default
(two 512-token sequences) the scheduler could hold only a few at a time, and the large buckets never ran."""


def test_small_random_gpt_oss_20_prompts_x_128_tokens():
    from ops.tools.make_tiny_gpt_oss import real_config

    core = dummy_core({**real_config("20b"), **SMALL_GPT_OSS}, torch.float32, max_model_len=512,
                      num_kv_blocks=GPT_OSS_PAGES)
    core.model.lm_head.weight.data.mul_(20)
    graphs = core.runner.graphs
    assert graphs is not None and graphs.batch_sizes[-1] == 256
    # 16 sequences at once (the batch-one kernels' limit): the last 4 prompts decode in the 4-bucket
    _lanes_agree(core, SMALL_GPT_OSS["vocab_size"], max_num_seqs=16)
    assert {16, 4} <= set(graphs._graphs), sorted(graphs._graphs)
    # all 20 at once: the 32-bucket graph, its MoE through the grouped MXFP4 GEMMs
    _lanes_agree(core, SMALL_GPT_OSS["vocab_size"])
    assert 32 in graphs._graphs and not graphs._failed, (sorted(graphs._graphs), sorted(graphs._failed))


class _LetterTokenizer:
    """A complete (if plain) tokenizer for random-weight models: id ``i`` is two letters, base 26. Stop strings
    then have text to match; the lane's stop checks do not depend on which tokenizer it is."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) + chr(97 + (i // 26) % 26) for i in ids)


def test_host_checks_on_captured_quanta_match_the_standard_lane():
    """Stop strings, stop ids under min_tokens (the host recomputes the banned position) on captured, pipelined
    quanta: the standard lane's tokens and text at every stop position of the first three quanta."""
    from ops.tools.model_shapes import SMOLLM2_135M
    from replicas.engine import LLMEngine
    from replicas.messages import GenerateRequest
    from replicas.persistent.cuda_graph import CudaGraphBackend
    from replicas.persistent.lane import PersistentLane
    from replicas.request import SamplingParams

    # untied: random weights with a tied LM head mostly predict the input token again (its embedding dominates
    # the residual stream); an LM head of its own makes the next token a random function of the last: varied text
    core = dummy_core({**SMOLLM2_135M, "tie_word_embeddings": False}, torch.float32, max_model_len=512)
    core.tokenizer = _LetterTokenizer()
    core.model.lm_head.weight.data.mul_(20)  # wide argmax margins
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in (37, 120, 250)]
    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def standard(params_by_id: dict) -> dict:
        """Each request's (tokens, text, finish) on the standard lane, text and stop strings as the served path's
        reader makes them (:func:`tests.replicas.conftest.run_standard`)."""
        from tests.replicas.conftest import run_standard

        out = run_standard(LLMEngine(core), params_by_id)
        return {rid: ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                      chunks[-1].finish_reason) for rid, chunks in out.items()}

    ref = standard({f"r{i}": (p, base) for i, p in enumerate(prompts)})
    cases = {}
    for i, p in enumerate(prompts):
        tokens, _, _ = ref[f"r{i}"]
        banned = tuple(dict.fromkeys(tokens[1:12:3]))  # ids the device emits inside the first quanta
        for k in range(25):
            # the text of the first k+1 tokens: a stop string first completed by token k (random weights
            # often repeat one token, so a shorter one could match earlier)
            stop = _LetterTokenizer().decode(tokens[: k + 1])
            cases[f"s{i}.{k}"] = (p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,)))
            # stop ids min_tokens bans for k+1 tokens: the host recomputes each position where one came out
            cases[f"m{i}.{k}"] = (p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=banned, min_tokens=k + 1))
    expected = standard(cases)
    lane = PersistentLane(core, CudaGraphBackend(core.model, torch.device("cuda"), core.config.max_model_len))
    assert lane.backend.use_graphs
    for rid, (p, params) in cases.items():
        chunks = list(lane.generate(GenerateRequest(rid, p, params)))
        got = ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason)
        assert got == expected[rid], rid
        assert core.allocator.num_free == core.allocator.num_blocks
    assert len(cases) > 100 and lane.min_tokens_recomputes > 0 and not lane.backend._in_flight




def test_decode_graphs_captured_smallest_first_then_replayed():
    """The order that made the first issue-18 H200 run fault at 16 sequences: every bucket captured up front,
    smallest first, then ``empty_cache`` (each capture starts with one), then 1, 8 and 16 sequences decoding
    through graphs captured before larger ones. The graphs of every bucket share the decode attention's
    workspace; replayed, they must find their buffers allocated. Tokens equal the eager engine's."""
    from ops.tools.make_tiny_gpt_oss import real_config
    from replicas.engine import LLMEngine
    from replicas.request import SamplingParams
    from replicas.scheduler import SchedulerConfig

    core = dummy_core({**real_config("20b"), **SMALL_GPT_OSS}, torch.float32, max_model_len=512,
                      num_kv_blocks=GPT_OSS_PAGES)
    core.model.lm_head.weight.data.mul_(20)
    graphs = core.runner.graphs
    for size in graphs.batch_sizes[:7]:  # 1 .. 48, smallest first (DecodeGraphs.capture_all goes largest first)
        graphs._capture(size)
    torch.cuda.empty_cache()
    g = torch.Generator().manual_seed(11)
    vocab = SMALL_GPT_OSS["vocab_size"]
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(20, 300, (16,), generator=g)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(batch):
        engine = LLMEngine(core, SchedulerConfig(256, 4096, True))
        for i, p in enumerate(batch):
            engine.add_request(f"r{i}", p, params)
        out = {f"r{i}": [] for i in range(len(batch))}
        while engine.has_unfinished():
            for ch in engine.step():
                out[ch.request_id] += ch.token_ids
        assert core.allocator.num_free == core.allocator.num_blocks
        return [out[f"r{i}"] for i in range(len(batch))]

    replays = graphs.replays
    with_graphs = [run(prompts[:c]) for c in (1, 8, 16)]
    torch.cuda.synchronize()
    assert graphs.replays > replays
    core.runner.graphs = None
    eager = [run(prompts[:c]) for c in (1, 8, 16)]
    core.runner.graphs = graphs
    assert with_graphs == eager


def test_warm_up_captures_every_bucket_and_serves_the_same_tokens():
    """``LLMEngine.warm_up`` (the engine actor's ``EngineConfig.warmup`` at load): every decode-graph bucket
    captured, the pool full again, and greedy tokens after it equal the tokens of an engine that did not
    warm up."""
    from ops.tools.make_tiny_gpt_oss import real_config
    from replicas.engine import LLMEngine
    from replicas.request import SamplingParams

    core = dummy_core({**real_config("20b"), **SMALL_GPT_OSS}, torch.bfloat16, max_model_len=512,
                      num_kv_blocks=GPT_OSS_PAGES)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, SMALL_GPT_OSS["vocab_size"], (n,), generator=g).tolist() for n in (17, 200, 90)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(engine):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        out = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for ch in engine.step():
                out[ch.request_id] += ch.token_ids
        return out

    cold = run(LLMEngine(core))
    engine = LLMEngine(core)
    done = engine.warm_up()
    graphs = core.runner.graphs
    assert done["graphs_failed"] == [] and set(graphs._graphs) == set(graphs.batch_sizes), done
    assert core.allocator.num_free == core.allocator.num_blocks
    assert run(engine) == cold
