"""On an NVIDIA GPU: the persistent lane's captured CUDA-graph quanta against the standard lane.

Run through the ``device`` tool: ``python -m pytest tests/gpu -q``. Weights are
random (SmolLM2-135M shape, fp32 so that both lanes' different attention
kernels agree to ~1e-6 and greedy ties are not an issue).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_cuda_graph_quanta_equal_standard_lane_20_prompts_x_128_tokens():
    from ops.bench_engine import SMOLLM2_135M, build_core
    from replicas.engine import LLMEngine
    from replicas.messages import GenerateRequest
    from replicas.persistent.cuda_graph import CudaGraphBackend
    from replicas.persistent.lane import PersistentLane
    from replicas.request import SamplingParams

    device = torch.device("cuda")
    core = build_core(SMOLLM2_135M, device, torch.float32, max_model_len=512)
    core.model.lm_head.weight.data.mul_(20)  # spread the random logits: wide argmax margins
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in torch.randint(20, 300, (20,), generator=g)]
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)

    engine = LLMEngine(core)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    standard: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for c in engine.step():
            standard[c.request_id] += c.token_ids
    assert core.allocator.num_free == core.allocator.num_blocks

    backend = CudaGraphBackend(core.model, device, 512)
    lane = PersistentLane(core, backend)
    assert backend.use_graphs and len(backend._graphs) == 8
    same = 0
    for i, p in enumerate(prompts):
        chunks = list(lane.generate(GenerateRequest(f"p{i}", p, params)))
        tokens = [t for c in chunks for t in c.token_ids]
        assert [len(c.token_ids) for c in chunks] == [1] + [8] * 15 + [7]
        same += tokens == standard[f"s{i}"]
    assert core.allocator.num_free == core.allocator.num_blocks
    assert same == len(prompts), f"{same}/{len(prompts)} prompts identical"
