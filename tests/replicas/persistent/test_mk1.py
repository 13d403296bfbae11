"""The ``mk1`` adapter (replicas/persistent/mk1.py) against a test double of the ``aiter.MK1`` boundary.

``tests/replicas/persistent/mk1_double`` is a test double of the aiter.MK1 module
boundary; it is not AMD's code and proves nothing about the real kernel. It is
injected at the adapter's one import seam (``mk1._import_mk1``). Everything on
our side is real: the envelope checks, the cache binding over a real bf16
:class:`KVCache` of GPT-OSS-120B's geometry (36 layers x 8 KV heads x 64,
tiny ``num_blocks``), the YaRN tables, the error mapping, and, at the end, a
real :class:`PersistentLane` over a tiny randomly initialised Llama with that
KV geometry (its prefill and the eager fallback are real; the quanta come from
the double).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import types

import pytest
import torch

import replicas.persistent.mk1 as mk1
from ops.tools.make_tiny_gpt_oss import real_config
from replicas.config import EngineConfig
from replicas.engine import EngineCore
from replicas.kv_cache import KVCache
from replicas.messages import GenerateRequest, GenerationChunk, GenerationError
from replicas.models.config import ModelConfig
from replicas.models.gpt_oss_config import GptOssConfig
from replicas.models.llama import LlamaForCausalLM
from replicas.persistent.checkpoint import MXFP4_PACKED_BYTES, CheckpointError, catalog
from replicas.persistent.contract import (
    BackendLaunchError,
    CacheBinding,
    InvalidQuantumResultError,
    NativeBinaryError,
    PrelaunchError,
    QuantumRequest,
    UnsupportedConfigurationError,
)
from replicas.persistent.eager import EagerBackend
from replicas.persistent.factory import BACKENDS, create_backend
from replicas.persistent.lane import PersistentLane
from replicas.request import SamplingParams
from tests.replicas.persistent.mk1_double import MK1Double, MK1Error, marker

GPT_OSS_120B = GptOssConfig.from_dict(real_config("120b"))
"""The config MK1 serves (its RoPE tables and EOS id come from it)."""

LAYERS, KVH, HEAD_DIM = 36, 8, 64
ROW_BYTES = KVH * HEAD_DIM * 2  # one token's K (or V) in one layer, bf16
SCRIPT = list(range(2, 30))  # tokens the double emits, in order (none is an EOS id of the tiny core)


# --- helpers ------------------------------------------------------------------------------------


def envelope(**overrides) -> mk1.Mk1Envelope:
    """An envelope inside MK1's support (a gfx950 ROCm device), with ``overrides`` applied."""
    facts = dict(
        device="cpu", platform="rocm", gpu_architecture="gfx950", kv_dtype=torch.bfloat16,
        kv_geometry=(LAYERS, KVH, HEAD_DIM), model_revision="b5c939de",
        prefix_caching=False, chunked_prefill=False, max_sequence_length=4096,
    )
    facts.update(overrides)
    return mk1.Mk1Envelope(**facts)


def gpt_oss_kv(num_blocks: int = 4, dtype=torch.bfloat16) -> torch.Tensor:
    """A real KV cache tensor of GPT-OSS-120B's geometry with ``num_blocks`` pages."""
    cfg = tiny_model_config()
    return KVCache(cfg, num_blocks, dtype, "cpu").tensor


def tiny_model_config(eos: tuple[int, ...] = (31,)) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=32, num_layers=LAYERS,
        num_heads=KVH, num_kv_heads=KVH, head_dim=HEAD_DIM, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=128, eos_token_ids=eos,
    )


@pytest.fixture
def double(monkeypatch) -> MK1Double:
    """A fresh double injected at the adapter's import seam."""
    d = MK1Double(script=SCRIPT)
    monkeypatch.setattr(mk1, "_import_mk1", lambda: d)
    return d


def write_manifest(path, family="gpt-oss-120b", revision="b5c939de", num_layers=LAYERS):
    """A manifest-valid persistent checkpoint directory (the full catalog, placeholder shapes, empty shard).

    It passes :func:`check_checkpoint_dir` (manifest only); its shard holds no
    tensors, which only the double's ``from_checkpoint`` would need (it does not).
    """
    shard = "persistent-00001-of-00001.safetensors"
    (path / shard).write_bytes(b"")
    tensors = []
    for slot in catalog(num_layers):
        shape = [1, 1, 1, MXFP4_PACKED_BYTES] if slot.mxfp4 else [1] * slot.rank
        dtype, size = ("mxfp4", MXFP4_PACKED_BYTES) if slot.mxfp4 else ("bfloat16", 2)
        tensors.append({"name": slot.name, "shard": shard, "dtype": dtype, "shape": shape, "byte_size": size})
    manifest = {"format_version": 2, "model_family": family, "model_revision": revision,
                "num_layers": num_layers, "tensors": tensors}
    (path / "persistent_decoder_manifest.json").write_text(json.dumps(manifest))
    return path


@pytest.fixture
def checkpoint(tmp_path):
    """A persistent checkpoint directory whose manifest names MK1's model family and revision."""
    return write_manifest(tmp_path)


def bound_backend(double, checkpoint, kv, **env) -> mk1.MK1Backend:
    backend = mk1.MK1Backend(envelope(**env), checkpoint, GPT_OSS_120B)
    backend.bind_cache(CacheBinding.from_kv_tensor(kv))
    return backend


def quantum_request(committed=20, max_tokens=8, pages=(3, 1), **kw) -> QuantumRequest:
    fields = dict(
        pending_token=7, committed_kv_length=committed, max_sequence_length=4096, max_tokens=max_tokens,
        full_block_map=torch.tensor(pages, dtype=torch.int32),
    )
    fields.update(kw)
    return QuantumRequest(**fields)


def assert_markers(kv: torch.Tensor, block_map: list[int], positions: range) -> None:
    """The double's marker bytes sit at ``page * 16384 + (pos % 16) * 1024`` of each plane, and nowhere else."""
    raw = kv.view(torch.uint8).reshape(2, LAYERS, -1)  # [plane, layer, bytes of the plane]
    stride = 16 * ROW_BYTES
    assert stride == 16 * 8 * 64 * 2 == 16384
    expected = torch.zeros_like(raw)
    for pos in positions:
        start = block_map[pos // 16] * stride + (pos % 16) * ROW_BYTES
        for layer in range(LAYERS):
            for plane in (0, 1):
                expected[plane, layer, start:start + ROW_BYTES] = marker(layer, pos, plane)
    assert torch.equal(raw, expected)


# --- import boundary ----------------------------------------------------------------------------


def test_importing_the_adapter_does_not_import_aiter():
    assert "aiter" not in sys.modules and "aiter.MK1" not in sys.modules
    assert mk1.MK1Backend.name == "mk1"


def test_missing_aiter_is_a_native_binary_error_saying_build_from_source(monkeypatch, checkpoint):
    monkeypatch.setitem(sys.modules, "aiter", None)  # makes `import aiter...` raise ImportError
    with pytest.raises(NativeBinaryError, match="built from source on a ROCm machine") as exc:
        mk1._import_mk1()
    assert "never `pip install aiter`" in str(exc.value)
    assert exc.value.reason == "native_binary_unavailable"
    with pytest.raises(NativeBinaryError, match="built from source"):
        mk1.MK1Backend(envelope(), checkpoint, GPT_OSS_120B)  # inside the envelope: the import is what fails


def test_an_aiter_without_the_mk1_surface_is_a_native_binary_error(monkeypatch):
    """E.g. the unrelated PyPI ``aiter`` (no MK1), or an aiter.MK1 of another commit."""
    partial = types.ModuleType("aiter.MK1")
    partial.MK1Config = object
    monkeypatch.setitem(sys.modules, "aiter", types.ModuleType("aiter"))
    monkeypatch.setitem(sys.modules, "aiter.MK1", partial)
    with pytest.raises(NativeBinaryError, match="lacks is_supported, PersistentDecoder") as exc:
        mk1._import_mk1()
    assert "4b492bb" in str(exc.value) and "built from source" in str(exc.value)


# --- envelope -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"platform": "rocm", "gpu_architecture": "gfx942"},
         "is an AMD GPU of architecture gfx942 (gcnArchName): aiter.MK1 runs only on gfx950 (MI355X)"),
        ({"device": "cuda:0", "platform": "cuda", "gpu_architecture": None},
         "device cuda:0 is an NVIDIA GPU (a CUDA build of torch: no gcnArchName): aiter.MK1 runs only on gfx950"),
        ({"platform": "cpu", "gpu_architecture": None},
         "device cpu is a cpu device, not an AMD GPU: aiter.MK1 runs only on gfx950"),
        ({"kv_dtype": torch.float32}, "KV cache dtype is float32: aiter.MK1 needs a bfloat16 KV cache"),
        ({"kv_dtype": torch.float16}, "KV cache dtype is float16: aiter.MK1 needs a bfloat16 KV cache"),
        ({"batch_size": 2}, "batch_size=2: aiter.MK1 decodes batch 1"),
        ({"model_revision": "0123abcd"}, "model revision '0123abcd' is not the gpt-oss-120b revision aiter.MK1 is built for (b5c939de)"),
        ({"model_revision": None}, "model revision unknown: aiter.MK1 is built for gpt-oss-120b revision b5c939de"),
        ({"model_family": "gpt-oss-20b"}, "model family 'gpt-oss-20b': aiter.MK1 is built for gpt-oss-120b"),
        ({"prefix_caching": True}, "prefix caching is on for the persistent lane: aiter.MK1 needs it off"),
        ({"chunked_prefill": True}, "chunked prefill is on for the persistent lane: aiter.MK1 needs it off"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2: aiter.MK1 runs one GPU per replica (TP 1)"),
        ({"pipeline_parallel_size": 4}, "pipeline_parallel_size=4: aiter.MK1 runs one GPU per replica (PP 1)"),
        ({"kv_geometry": (24, 8, 64)}, "(layers, kv_heads, head_dim) = (24, 8, 64) is not gpt-oss-120b's (36, 8, 64)"),
    ],
    ids=["gfx942", "nvidia", "cpu", "fp32_cache", "fp16_cache", "batch2", "wrong_revision", "unknown_revision", "gpt_oss_20b",
         "prefix_caching", "chunked_prefill", "tp2", "pp4", "gpt_oss_20b_geometry"],
)
def test_each_envelope_rule_gives_its_precise_reason(double, checkpoint, overrides, reason):
    env = envelope(**overrides)
    reasons = mk1.envelope_reasons(env)
    assert len(reasons) == 1 and reason in reasons[0], reasons
    with pytest.raises(mk1.Mk1EnvelopeError) as exc:
        mk1.MK1Backend(env, checkpoint, GPT_OSS_120B)
    assert exc.value.reasons == tuple(reasons) and reason in str(exc.value)
    assert isinstance(exc.value, UnsupportedConfigurationError) and exc.value.reason == "unsupported_envelope"
    assert double.calls == []  # judged before aiter is touched


def test_the_supported_envelope_has_no_reasons_and_every_broken_rule_is_listed():
    assert mk1.envelope_reasons(envelope()) == []
    many = mk1.envelope_reasons(envelope(kv_dtype=torch.float32, batch_size=3, prefix_caching=True))
    assert len(many) == 3


def test_probe_reads_gcn_arch_name_on_rocm_only(monkeypatch):
    assert mk1.probe_gpu_architecture("cpu") == ("cpu", None)
    asked = []

    def props(device):
        asked.append(device)
        return types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-")

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.version, "hip", None)  # an NVIDIA (CUDA) build
    assert mk1.probe_gpu_architecture("cuda:0") == ("cuda", None)
    assert asked == []
    monkeypatch.setattr(torch.version, "hip", "6.4.0")  # a ROCm build
    assert mk1.probe_gpu_architecture("cuda:1") == ("rocm", "gfx950")
    assert asked == [torch.device("cuda:1")]


# --- construction -------------------------------------------------------------------------------


def test_construction_passes_the_mk1_config_and_loads_the_checkpoint(double, checkpoint):
    backend = mk1.MK1Backend(envelope(max_sequence_length=2048), checkpoint, GPT_OSS_120B)
    cfg = backend.config
    assert (cfg.device, cfg.max_sequence_length, cfg.cache_scalar, cfg.batch_size) == (torch.device("cpu"), 2048, "bfloat16", 1)
    assert (cfg.backend, cfg.model_family, cfg.model_revision) == ("gpt_oss_gfx950_atom_v1", "gpt-oss-120b", "b5c939de")
    assert (cfg.gpu_architecture, cfg.mode) == ("gfx950", "required")
    assert [c.name for c in double.calls] == ["is_supported", "from_checkpoint", "is_supported"]
    assert double.calls_named("from_checkpoint")[0].args["checkpoint_dir"] == str(checkpoint)
    assert backend.checks_stop_set_on_device is False


def test_is_supported_refusal_is_unsupported_configuration(double, checkpoint):
    double.is_supported = lambda cfg: (False, ["native says no"])
    with pytest.raises(UnsupportedConfigurationError, match="is_supported refused the config: native says no"):
        mk1.MK1Backend(envelope(), checkpoint, GPT_OSS_120B)


@pytest.mark.parametrize(
    ("fault", "ours"),
    [("checkpoint", CheckpointError), ("unsupported", UnsupportedConfigurationError), ("native", NativeBinaryError)],
)
def test_construction_errors_map_to_ours(double, checkpoint, fault, ours):
    double.construction_fault = fault
    with pytest.raises(ours, match="aiter.MK1 PersistentDecoder.from_checkpoint") as exc:
        mk1.MK1Backend(envelope(), checkpoint, GPT_OSS_120B)
    assert isinstance(exc.value.__cause__, MK1Error)  # chained to the (double's) aiter error


def test_unknown_mk1_mode_is_refused(double, checkpoint):
    with pytest.raises(UnsupportedConfigurationError, match="mode 'fast'"):
        mk1.MK1Backend(envelope(), checkpoint, GPT_OSS_120B, mode="fast")


# --- cache binding ------------------------------------------------------------------------------


def test_binding_is_flat_uint8_views_of_our_kv_tensor_with_16384_bytes_per_page(double, checkpoint):
    kv = gpt_oss_kv(num_blocks=3)
    backend = bound_backend(double, checkpoint, kv)
    (call,) = double.calls_named("bind_cache")
    atom = call.args["binding"]
    assert isinstance(atom, double.AtomCacheBinding)
    assert atom.block_strides == (16 * 8 * 64 * 2,) * LAYERS == (16384,) * LAYERS
    assert atom.block_counts == (3,) * LAYERS and atom.pools == (0,) * LAYERS
    assert len(atom.key_planes) == len(atom.value_planes) == LAYERS
    for layer in range(LAYERS):
        for plane, ours in ((atom.key_planes[layer], kv[0, layer]), (atom.value_planes[layer], kv[1, layer])):
            assert plane.dtype == torch.uint8 and plane.dim() == 1 and plane.is_contiguous()
            assert plane.numel() == 3 * 16384
            assert plane.data_ptr() == ours.data_ptr()  # a view of our storage, not a copy
            assert plane.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    atom.value_planes[5][16384 + 2 * ROW_BYTES:16384 + 2 * ROW_BYTES + 2] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)
    assert kv[1, 5, 1, 2, 0, 0].item() == 1.0  # bf16 1.0 written as bytes lands in page 1, slot 2
    assert backend._bound


@pytest.mark.parametrize(
    ("kv", "match"),
    [
        (lambda: gpt_oss_kv(dtype=torch.float32), "binds a bfloat16 cache"),
        (lambda: torch.zeros(2, 2, 3, 16, KVH, HEAD_DIM, dtype=torch.bfloat16), r"\(2, 8, 64\)"),
    ],
    ids=["fp32", "two_layers"],
)
def test_binding_refuses_a_cache_mk1_cannot_use(double, checkpoint, kv, match):
    backend = mk1.MK1Backend(envelope(), checkpoint, GPT_OSS_120B)
    with pytest.raises(UnsupportedConfigurationError, match=match):
        backend.bind_cache(CacheBinding.from_kv_tensor(kv()))
    assert double.calls_named("bind_cache") == []


# --- quantum requests and results ---------------------------------------------------------------


def _yarn_reference(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS YaRN cos/sin ``[length, 32]`` in float64, written from the formula (Peng et al. 2023).

    head_dim d = 64, theta b = 150000, scale s = 32, beta_fast 32, beta_slow 1,
    original context L = 4096, no truncation of the correction range.
    """
    d, b, s, L = 64, 150000.0, 32.0, 4096

    def correction_dim(rotations):
        return d * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(b))

    low, high = max(correction_dim(32.0), 0.0), min(correction_dim(1.0), d - 1.0)
    inv = []
    for i in range(d // 2):
        theta_i = b ** (-2.0 * i / d)
        gamma = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep theta_i (high freq), 1: theta_i / s
        inv.append(theta_i * (1 - gamma) + theta_i / s * gamma)
    mscale = 0.1 * math.log(s) + 1.0
    angles = torch.arange(length, dtype=torch.float64)[:, None] * torch.tensor(inv, dtype=torch.float64)[None, :]
    return angles.cos() * mscale, angles.sin() * mscale


def test_quantum_request_block_map_and_yarn_rope_tables(double, checkpoint):
    kv = gpt_oss_kv(num_blocks=4)
    backend = bound_backend(double, checkpoint, kv, max_sequence_length=4096)
    result = backend.run_quantum(quantum_request(committed=20, max_tokens=8, pages=(3, 1)))
    (call,) = double.calls_named("run_quantum")
    native = call.args["request"]
    assert isinstance(native, double.QuantumRequest)
    bm = native.full_block_map
    assert bm.dtype == torch.int32 and bm.dim() == 1 and bm.is_contiguous() and bm.tolist() == [3, 1]
    assert bm.numel() * 16 >= native.committed_kv_length + native.max_tokens == 28
    assert (native.pending_token, native.committed_kv_length, native.max_tokens) == (7, 20, 8)
    # no stop id: MK1 gets the model's EOS id with its ignore_eos flag
    assert (native.max_sequence_length, native.eos_token_id, native.ignore_eos) == (4096, 200002, True)
    assert native.sliding_block_map is None and native.cancellation_flag is None
    cos, sin = native.rope_cosine, native.rope_sine
    assert cos.shape == sin.shape == (4096, 64) and cos.dtype == sin.dtype == torch.bfloat16
    assert not cos[:, 32:].any() and not sin[:, 32:].any()  # columns 32..63 are zero
    ref_cos, ref_sin = _yarn_reference(4096)
    assert torch.allclose(cos[:, :32].double(), ref_cos, rtol=0, atol=2**-7)  # one bf16 ulp at |x| in [1, 2)
    assert torch.allclose(sin[:, :32].double(), ref_sin, rtol=0, atol=2**-7)
    assert cos[0, 0].item() == torch.tensor(1.0 + 0.1 * math.log(32)).bfloat16().item() and sin[0].abs().sum() == 0
    # the result came back converted and checked; the KV went through OUR cache at page*stride offsets
    assert (result.emitted_tokens, result.committed_kv_length, result.pending_token) == (SCRIPT[:8], 28, SCRIPT[7])
    assert result.finish_reason == "max_tokens" and result.completed_epochs == 8
    assert_markers(kv, [3, 1], range(20, 28))


TRANSFORMERS_GPT_OSS_INV_FREQ = (
    "0x1.0000000000000p+0", "0x1.60ca6a0000000p-1", "0x1.e62d440000000p-2", "0x1.4eff540000000p-2",
    "0x1.cda7f40000000p-3", "0x1.3e19fa0000000p-3", "0x1.b65f3e0000000p-4", "0x1.2e0ec80000000p-4",
    "0x1.a043280000000p-5", "0x1.03bbaa0000000p-5", "0x1.3cc8de0000000p-6", "0x1.7bd9280000000p-7",
    "0x1.bd50800000000p-8", "0x1.f9fc280000000p-9", "0x1.1270060000000p-9", "0x1.13eef00000000p-10",
    "0x1.dea8780000000p-12", "0x1.0f33720000000p-13", "0x1.415b8c0000000p-15", "0x1.badbf80000000p-16",
    "0x1.3126500000000p-16", "0x1.a485f40000000p-17", "0x1.21c2580000000p-17", "0x1.8f50560000000p-18",
    "0x1.1325180000000p-18", "0x1.7b2c8e0000000p-19", "0x1.05448a0000000p-19", "0x1.680cd00000000p-20",
    "0x1.f02e500000000p-21", "0x1.55e4000000000p-21", "0x1.d727d60000000p-22", "0x1.44a5a60000000p-22",
)
"""``GptOssRotaryEmbedding(GptOssConfig()).inv_freq`` (fp32) from transformers 5.24.0, as ``float.hex``:
the documented source (``_compute_yarn_parameters``), frozen so this file need not import transformers."""


def test_inv_freq_and_attention_factor_equal_transformers_yarn_for_gpt_oss():
    """MK1's tables come from the model's own RoPE (``rope_inv_freq`` over its config), which for gpt-oss-120b
    is transformers' YaRN bit for bit."""
    from replicas.models.gpt_oss import rope_inv_freq

    ours, mscale = rope_inv_freq(GPT_OSS_120B.head_dim, GPT_OSS_120B.rope_theta, GPT_OSS_120B.rope_scaling)
    assert ours.dtype == torch.float32 and ours.shape == (32,)
    assert ours.tolist() == [float.fromhex(h) for h in TRANSFORMERS_GPT_OSS_INV_FREQ]  # bit for bit
    assert mscale == float.fromhex("0x1.58b90bfbe8e7cp+0")  # 0.1 ln 32 + 1


def test_rope_tables_equal_transformers_gpt_oss_rotary_embedding():
    """Live check against transformers' GPT-OSS rotary embedding (the reference implementation)."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    rotary = GptOssRotaryEmbedding(transformers.GptOssConfig())
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.bfloat16), torch.arange(8192)[None])
    cos, sin = mk1.mk1_rope_tables(8192, GPT_OSS_120B)
    assert torch.equal(cos[:, :32], hf_cos[0]) and torch.equal(sin[:, :32], hf_sin[0])


def test_a_single_stop_id_becomes_mk1_eos_and_ends_the_quantum(double, checkpoint):
    kv = gpt_oss_kv()
    backend = bound_backend(double, checkpoint, kv)
    stop = SCRIPT[2]
    result = backend.run_quantum(quantum_request(committed=0, pages=(2,), stop_token_ids=(stop,)))
    native = double.calls_named("run_quantum")[0].args["request"]
    assert (native.eos_token_id, native.ignore_eos) == (stop, False)
    assert result.emitted_tokens == SCRIPT[:3] and result.finish_reason == "eos" and result.committed_kv_length == 3
    assert_markers(kv, [2], range(0, 3))


def test_several_stop_ids_run_full_quanta_with_one_of_them_as_mk1_eos(double, checkpoint):
    """MK1 checks one eos id: with several stop ids the quantum keeps its size (the lane cuts the output at the
    first stop id on the host), and MK1's eos is the model's primary EOS when it is one of them, else the smallest."""
    assert mk1.MK1Backend.checks_stop_set_on_device is False
    backend = bound_backend(double, checkpoint, gpt_oss_kv())
    primary = backend.eos_token_id  # the model's smallest EOS id
    result = backend.run_quantum(quantum_request(max_tokens=4, stop_token_ids=(30, primary)))
    assert result.emitted_tokens == SCRIPT[:4]
    native = double.calls_named("run_quantum")[-1].args["request"]
    assert (native.max_tokens, native.eos_token_id, native.ignore_eos) == (4, primary, False)
    backend.run_quantum(quantum_request(max_tokens=2, stop_token_ids=(41, 40)))
    native = double.calls_named("run_quantum")[-1].args["request"]
    assert (native.max_tokens, native.eos_token_id, native.ignore_eos) == (2, 40, False)


# --- errors -------------------------------------------------------------------------------------


def test_aiter_prelaunch_error_is_our_prelaunch_error_and_leaves_the_backend_usable(double, checkpoint):
    kv = gpt_oss_kv()
    backend = bound_backend(double, checkpoint, kv)
    double.fail_next("prelaunch")
    with pytest.raises(PrelaunchError, match="injected prelaunch rejection") as exc:
        backend.run_quantum(quantum_request())
    assert not isinstance(exc.value, BackendLaunchError) and exc.value.reason == "unsupported_envelope"
    assert kv.count_nonzero() == 0  # the cache is untouched
    assert backend.unhealthy_reason is None
    assert backend.run_quantum(quantum_request()).emitted_tokens == SCRIPT[:8]


def test_aiter_backend_launch_error_is_terminal_and_the_decoder_turns_unhealthy(double, checkpoint):
    kv = gpt_oss_kv()
    backend = bound_backend(double, checkpoint, kv)
    double.fail_next("launch")
    with pytest.raises(BackendLaunchError, match="failed after launch: injected failure") as exc:
        backend.run_quantum(quantum_request())
    assert not isinstance(exc.value, InvalidQuantumResultError) and exc.value.reason == "backend_launch_error"
    assert kv.count_nonzero() > 0  # the launch had already written KV: that is why it is terminal
    assert backend.unhealthy_reason == "backend_launch_error"
    with pytest.raises(PrelaunchError) as again:
        backend.run_quantum(quantum_request())
    assert again.value.reason == "decoder_unhealthy"
    assert len(double.calls_named("run_quantum")) == 1  # never launched again


def test_any_other_exception_from_the_launch_is_terminal_too(double, checkpoint):
    backend = bound_backend(double, checkpoint, gpt_oss_kv())
    double.script = []  # the double raises once its script runs out, after writing KV
    with pytest.raises(BackendLaunchError):
        backend.run_quantum(quantum_request())
    assert backend.unhealthy_reason == "backend_launch_error"


@pytest.mark.parametrize(
    ("fault", "match"),
    [
        ("zero", "emitted 0 tokens"), ("too_many", "emitted 9 tokens"),
        ("committed", "committed_kv_length 29 != 20 \\+ 8"), ("pending", "pending_token"),
        ("garbage", "unreadable result"),
    ],
)
def test_an_invalid_result_is_an_invalid_quantum_result_error(double, checkpoint, fault, match):
    backend = bound_backend(double, checkpoint, gpt_oss_kv())
    double.fail_next(fault)
    with pytest.raises(InvalidQuantumResultError, match=match) as exc:
        backend.run_quantum(quantum_request())
    assert isinstance(exc.value, BackendLaunchError)
    assert backend.unhealthy_reason == "invalid_quantum_result"


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: quantum_request(full_block_map=torch.tensor([3, 1], dtype=torch.int64)), "unsupported_envelope"),
        (lambda: quantum_request(pages=(3, 4)), "unsupported_envelope"),  # page 4 of 4 does not exist
        (lambda: quantum_request(pages=(3,)), "unsupported_envelope"),  # 16 positions < 28
        (lambda: quantum_request(max_sequence_length=8192), "max_sequence_length"),  # longer than the decoder's tables
        (lambda: quantum_request(cancellation_flag=_set_event()), "cancelled"),
    ],
    ids=["int64_map", "page_out_of_range", "short_map", "past_decoder_length", "cancelled"],
)
def test_our_prelaunch_checks_refuse_before_any_launch(double, checkpoint, make, reason):
    backend = bound_backend(double, checkpoint, gpt_oss_kv(num_blocks=4))
    with pytest.raises(PrelaunchError) as exc:
        backend.run_quantum(make())
    assert exc.value.reason == reason
    assert double.calls_named("run_quantum") == [] and backend.unhealthy_reason is None


def test_an_unbound_backend_refuses_before_launch(double, checkpoint):
    with pytest.raises(PrelaunchError, match="no KV cache bound"):
        mk1.MK1Backend(envelope(), checkpoint, GPT_OSS_120B).run_quantum(quantum_request())


def _set_event() -> threading.Event:
    e = threading.Event()
    e.set()
    return e


# --- factory and lane over a tiny real engine core ----------------------------------------------


class _IdTokenizer:
    """Enough tokenizer for the detokenizer: token ``t`` decodes to ``<t>``."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def tiny_core(eos: tuple[int, ...] = (31,), num_blocks: int = 6, prefix_caching: bool = False) -> EngineCore:
    """A real :class:`EngineCore` over a tiny random Llama with GPT-OSS-120B's KV geometry (bf16, CPU).

    Its LM head is zero, so every real forward (the prefill, the eager
    fallback) picks token 0: the lane's non-MK1 tokens are predictable.
    """
    torch.manual_seed(0)
    cfg = tiny_model_config(eos)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    torch.nn.init.zeros_(model.lm_head.weight)
    config = EngineConfig(model="tiny-gpt-oss-shaped-llama", device="cpu", dtype="bfloat16", max_model_len=64,
                          num_kv_blocks=num_blocks, progress=False)
    return EngineCore.build(config, model, _IdTokenizer(), enable_prefix_caching=prefix_caching,
                            eos_token_ids=frozenset(eos))


@pytest.fixture
def on_gfx950(monkeypatch):
    """Pretend the CPU device reads as a gfx950 ROCm GPU (only the probe is replaced)."""
    monkeypatch.setattr(mk1, "probe_gpu_architecture", lambda device: ("rocm", "gfx950"))


def _request(rid: str, max_tokens: int = 17, **params) -> GenerateRequest:
    params.setdefault("ignore_eos", True)
    return GenerateRequest(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))


def _lane(double, checkpoint, **core_kw) -> tuple[PersistentLane, EngineCore]:
    core = tiny_core(**core_kw)
    backend = create_backend("mk1", core, str(checkpoint))
    assert isinstance(backend, mk1.MK1Backend)
    return PersistentLane(core, backend), core


def test_factory_knows_mk1_and_keeps_eager_as_auto(double, checkpoint):
    assert "mk1" in BACKENDS
    core = tiny_core()
    assert isinstance(create_backend("auto", core), EagerBackend)
    assert isinstance(create_backend("eager", core, str(checkpoint)), EagerBackend)
    with pytest.raises(CheckpointError, match="needs a persistent-decoder checkpoint directory"):
        create_backend("mk1", core, None)
    with pytest.raises(mk1.Mk1EnvelopeError) as exc:  # the real probe: this machine's CPU
        create_backend("mk1", core, str(checkpoint))
    assert exc.value.reasons == ("device cpu is a cpu device, not an AMD GPU: aiter.MK1 runs only on gfx950 (MI355X)",)
    assert double.calls == []


def test_factory_reads_family_and_revision_from_the_manifest_and_prefix_caching_from_the_allocator(
    double, checkpoint, on_gfx950, tmp_path_factory
):
    other = write_manifest(tmp_path_factory.mktemp("rev"), revision="deadbeef")
    with pytest.raises(mk1.Mk1EnvelopeError, match="model revision 'deadbeef'"):
        create_backend("mk1", tiny_core(), str(other))
    tiny = write_manifest(tmp_path_factory.mktemp("tiny"), family="gpt-oss-tiny", num_layers=2)
    with pytest.raises(mk1.Mk1EnvelopeError, match="model family 'gpt-oss-tiny'"):
        create_backend("mk1", tiny_core(), str(tiny))
    with pytest.raises(mk1.Mk1EnvelopeError, match="prefix caching is on"):
        create_backend("mk1", tiny_core(prefix_caching=True), str(checkpoint))


def test_factory_without_aiter_is_a_native_binary_error(monkeypatch, checkpoint, on_gfx950):
    monkeypatch.setitem(sys.modules, "aiter", None)
    with pytest.raises(NativeBinaryError, match="built from source"):
        create_backend("mk1", tiny_core(), str(checkpoint))


def test_lane_streams_mk1_quanta_written_through_the_engine_cache(double, checkpoint, on_gfx950):
    lane, core = _lane(double, checkpoint)
    items = list(lane.generate(_request("r")))
    assert all(isinstance(i, GenerationChunk) for i in items), items
    assert [len(c.token_ids) for c in items] == [1, 8, 8]
    assert [t for c in items for t in c.token_ids] == [0] + SCRIPT[:16]  # prefill's token, then MK1's
    assert items[-1].finish_reason == "length" and lane.healthy and lane.quanta_run == 2
    requests = [c.args["request"] for c in double.calls_named("run_quantum")]
    assert [(r.pending_token, r.committed_kv_length, r.max_tokens) for r in requests] == [(0, 5, 8), (SCRIPT[7], 13, 8)]
    assert [r.full_block_map.tolist() for r in requests] == [[0], [0, 1]]
    # MK1 wrote positions 5..20 through the engine's own cache; the prefill wrote 0..4
    raw = core.kv_cache.tensor.view(torch.uint8).reshape(2, LAYERS, -1)
    stride = 16384
    for pos in range(5, 21):
        start = [0, 1][pos // 16] * stride + (pos % 16) * ROW_BYTES
        assert (raw[0, 3, start:start + ROW_BYTES] == marker(3, pos, 0)).all()
        assert (raw[1, 35, start:start + ROW_BYTES] == marker(35, pos, 1)).all()
    assert core.kv_cache.tensor[:, :, 0, :5].abs().sum() > 0
    assert core.allocator.num_free == core.allocator.num_blocks


def test_lane_with_several_stop_ids_runs_full_quanta_and_cuts_at_the_first(double, checkpoint, on_gfx950):
    """Two EOS ids and a stop token id the double emits mid-quantum: MK1 (eos 30) decodes past it, the lane cuts
    the output right after it, drops the rest of the quantum and frees every page."""
    lane, core = _lane(double, checkpoint, eos=(30, 31))
    stop = SCRIPT[4]
    items = list(lane.generate(_request("r", max_tokens=17, ignore_eos=False, stop_token_ids=(stop,))))
    assert [c.token_ids for c in items] == [[0], SCRIPT[:5]]  # the prefill token, then the quantum cut at the stop
    assert items[-1].finish_reason == "stop" and items[-1].num_output_tokens == 6
    natives = [r.args["request"] for r in double.calls_named("run_quantum")]
    assert [(n.max_tokens, n.eos_token_id) for n in natives] == [(8, 30)]
    assert core.allocator.num_free == core.allocator.num_blocks
    items = list(lane.generate(_request("s", max_tokens=13, ignore_eos=False)))  # no stop reached: full quanta
    assert [len(c.token_ids) for c in items] == [1, 8, 4]


def test_lane_falls_back_to_the_reference_decode_on_an_aiter_prelaunch_error(double, checkpoint, on_gfx950):
    lane, core = _lane(double, checkpoint)
    double.fail_next("prelaunch")
    items = list(lane.generate(_request("f", max_tokens=17)))
    assert all(isinstance(i, GenerationChunk) for i in items), items
    assert [len(c.token_ids) for c in items] == [1, 8, 8]
    assert [c.fallback_reason for c in items] == [None, "unsupported_envelope", None]
    assert items[1].token_ids == [0] * 8  # the eager reference decoded it (the tiny model's zero LM head)
    assert lane.healthy
    assert core.allocator.num_free == core.allocator.num_blocks


@pytest.mark.parametrize(("fault", "reason"), [("launch", "backend_launch_error"), ("pending", "invalid_quantum_result")])
def test_lane_failure_after_launch_is_terminal_and_marks_the_decoder_unhealthy(double, checkpoint, on_gfx950, fault, reason):
    lane, core = _lane(double, checkpoint)
    double.fail_next(fault)
    items = list(lane.generate(_request("r")))
    assert [type(i) for i in items] == [GenerationChunk, GenerationError]
    assert (items[1].stage, items[1].reason) == ("postlaunch", reason)
    assert not lane.healthy and lane.unhealthy_reason == reason
    assert core.allocator.num_free == core.allocator.num_blocks
    (rejected,) = list(lane.generate(_request("next")))
    assert rejected.reason == "decoder_unhealthy"
    assert len(double.calls_named("run_quantum")) == 1
