"""After ``LLMEngine.warm_up``, serving compiles no Triton kernel: staggered arrivals of odd lengths beside
running decodes (the token counts of a first burst of requests) find every kernel variant compiled.

Counted from each kernel's own cache of compiled variants (``JITFunction.device_caches``), not timed. Written
while looking for why the first burst of 8 concurrent GPT-OSS requests through Serve on the H200 waited
seconds that the engine-direct run did not (``docs/decisions/0006-warm-up-every-grouped-gemm-height.md``). Its steps never hold more tokens than
the warm-up's, so it did not catch that cause: the 120b burst's 4,096-token step needed the 128-row grouped
GEMMs, which a warm-up of one prompt per height (at most ``max_model_len`` tokens) never reached. The CPU
test ``tests/replicas/models/test_gpt_oss.py::test_warm_up_reaches_every_grouped_gemm_height_a_step_can_take``
covers that case.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

from tests.gpu.conftest import dummy_core
from tests.gpu.test_cuda_graph_lane import GPT_OSS_PAGES, SMALL_GPT_OSS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _jit_functions() -> dict[str, object]:
    """Every ``@triton.jit`` function of :mod:`replicas.kernels`, by qualified name."""
    from triton.runtime.jit import JITFunction

    import replicas.kernels as pkg

    out = {}
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a backend this GPU cannot load (e.g. the MK1 library)
            continue
        for name, value in vars(module).items():
            if isinstance(value, JITFunction):
                out[f"{info.name}.{name}"] = value
    return out


def _variants(functions: dict) -> dict[str, int]:
    return {name: sum(len(c[0]) for c in fn.device_caches.values()) for name, fn in functions.items()}


def test_a_burst_of_staggered_requests_compiles_nothing_after_warm_up():
    from ops.tools.make_tiny_gpt_oss import real_config
    from replicas.engine import LLMEngine
    from replicas.request import SamplingParams

    core = dummy_core({**real_config("20b"), **SMALL_GPT_OSS}, torch.bfloat16, max_model_len=512,
                      num_kv_blocks=GPT_OSS_PAGES)
    engine = LLMEngine(core)
    engine.warm_up()
    functions = _jit_functions()
    before = _variants(functions)
    g = torch.Generator().manual_seed(11)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((257, 258, 259, 261, 263, 37, 301, 5)):  # one arrival per step, beside the decodes
        engine.add_request(f"r{i}", torch.randint(3, SMALL_GPT_OSS["vocab_size"], (n,), generator=g).tolist(),
                           params)
        engine.step()
    while engine.has_unfinished():
        engine.step()
    after = _variants(functions)
    compiled = {name: after[name] - before[name] for name in after if after[name] != before[name]}
    assert compiled == {}, f"compiled while serving: {compiled}"
    assert core.allocator.num_free == core.allocator.num_blocks
