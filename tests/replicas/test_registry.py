"""The one registry pattern (:mod:`replicas.registry`): MoE backends, persistent backends and model families.

A toy implementation registered here is resolvable and appears in the config's and the CLI's choices, and
is gone again once unregistered; the built-in names, their order and the messages are unchanged.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from deployments.cli import build_parser
from deployments.config import AppConfig
from replicas.config import EngineConfig
from replicas.kernels.moe import MOE_BACKENDS, TILE_KEYS, MoE, MoEBackendError, resolve_moe
from replicas.kernels.moe.backends import MOE_REGISTRY, HopperBulk, MoEBackend, TritonFp32, TritonTc
from replicas.models.base import MODELS, CausalLM, check_model
from replicas.models.registry import MODEL_TYPES, model_class
from replicas.persistent import BACKENDS
from replicas.persistent.contract import PERSISTENT_BACKENDS, PersistentBackend
from replicas.persistent.eager import EagerBackend
from replicas.persistent.factory import backend_takes_cached_pages, create_backend
from replicas.registry import Registry


def _cli_choices(dest: str) -> list[str]:
    return next(a.choices for a in build_parser()._actions if a.dest == dest)


def test_registry_registers_in_order_and_refuses_duplicates_and_foreign_classes():
    class Base:
        pass

    reg: Registry[type[Base]] = Registry("widget", Base)

    @reg.register("b")
    class B(Base):
        pass

    @reg.register("a")
    class A(Base):
        pass

    assert reg.names() == ("b", "a") and list(reg) == ["b", "a"] and len(reg) == 2
    assert reg.get("a") is A and A.name == "a" and "b" in reg and "c" not in reg
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(A)
    with pytest.raises(TypeError, match="not a subclass of Base"):
        reg.register("c")(int)
    with pytest.raises(KeyError, match="unknown widget 'c'; registered: b, a"):
        reg.get("c")
    assert reg.unregister("b") is B and reg.names() == ("a",)


def test_the_listed_modules_entries_come_first_in_their_order_whatever_the_import_order():
    reg = Registry("thing", modules=("json", "os"))  # two importable modules stand in for backend files
    x, in_os, in_json = (type(n, (), {"__module__": m}) for n, m in (("X", "tests"), ("B", "os"), ("A", "json")))
    for name, entry in (("x", x), ("b", in_os), ("a", in_json)):
        reg.register(name)(entry)
    assert reg.names() == ("a", "b", "x")


def test_builtin_names_and_order_are_unchanged():
    assert MOE_BACKENDS == MOE_REGISTRY.names() == (
        "hopper_bulk", "triton_tc", "triton_fp32", "triton_portable", "reference")
    assert TILE_KEYS["reference"] == () and TILE_KEYS["triton_portable"] == ("block_j", "block_r", "groups_per_tile")
    assert BACKENDS == ("auto", "eager", "cuda_graph", "mk1")
    assert MODEL_TYPES == MODELS.names() == ("llama", "gpt_oss")
    assert _cli_choices("moe_backend") == ["auto", *MOE_BACKENDS]
    assert _cli_choices("persistent_backend") == list(BACKENDS)
    # capabilities, read before anything is loaded
    assert [n for n, c in MOE_REGISTRY.items() if c.returns_partials] == ["hopper_bulk", "triton_tc", "triton_fp32"]
    assert [n for n, c in MOE_REGISTRY.items() if c.takes_mxfp4_activations] == ["hopper_bulk", "triton_tc"]
    assert [n for n, c in MOE_REGISTRY.items() if c.repacks_experts] == ["hopper_bulk"]
    assert [n for n, c in MOE_REGISTRY.items() if c.adds_residual] == ["triton_portable"]
    assert not PERSISTENT_BACKENDS.get("mk1").takes_cached_pages
    assert backend_takes_cached_pages("auto") and not backend_takes_cached_pages("mk1")


def test_why_not_messages_on_a_cuda_device_without_touching_it():
    """The device/dtype checks before any CUDA call (no GPU needed): the same texts as before the registry."""
    pytest.importorskip("triton")
    if torch.version.hip:
        pytest.skip("ROCm torch")
    cuda = torch.device("cuda")
    assert TritonFp32.why_not(cuda, torch.bfloat16) == "is for fp32 models"
    assert TritonTc.why_not(cuda, torch.float32) == "rounds activations to bf16; fp32 models use triton_fp32"
    assert TritonTc.why_not(cuda, torch.float16) is None
    assert HopperBulk.why_not(cuda, torch.float16) == "needs a bf16 model"
    assert HopperBulk.why_not(cuda, torch.float32) == "rounds activations to bf16; fp32 models use triton_fp32"


@pytest.fixture
def toy_moe():
    """A toy MoE backend, registered for one test (after ``reference``: ``auto`` never reaches it)."""
    kernel = object()

    @MOE_REGISTRY.register("toy")
    class Toy(MoEBackend):
        tile_keys = ("block",)

        @classmethod
        def why_not(cls, device, dtype):
            return None if dtype == torch.float32 else "is a toy for fp32"

        @classmethod
        def load(cls, tiles, *, repack, pdl):
            return kernel

    yield Toy, kernel
    MOE_REGISTRY.unregister("toy")


def test_a_registered_moe_backend_is_resolvable_and_a_config_choice(toy_moe):
    toy, kernel = toy_moe
    choice = resolve_moe("toy", torch.device("cpu"), torch.float32, tiles={"block": 4})
    assert (choice.backend, choice.reason, choice.tiles, choice.repack) == ("toy", "config", {"block": 4}, False)
    moe = MoE(choice)
    assert moe.backend is toy and moe._decode is kernel and not moe.takes_mxfp4_activations
    with pytest.raises(MoEBackendError, match=r"moe_backend=toy is a toy for fp32 \(device cpu, dtype bfloat16\)"):
        resolve_moe("toy", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(MoEBackendError, match=r"moe_tiles \['pairs'\] are not tiles of toy \(its tiles: block\)"):
        resolve_moe("toy", torch.device("cpu"), torch.float32, tiles={"pairs": 2})
    assert resolve_moe("auto", torch.device("cpu"), torch.float32).backend == "reference"  # order unchanged
    assert EngineConfig(moe_backend="toy").moe_backend == "toy"
    assert "toy" in _cli_choices("moe_backend")


def test_an_unregistered_moe_backend_is_refused_everywhere(toy_moe):
    MOE_REGISTRY.unregister("toy")
    try:
        with pytest.raises(ValidationError, match="moe_backend"):
            EngineConfig(moe_backend="toy")
        with pytest.raises(MoEBackendError, match="unknown moe_backend 'toy'; choose auto or one of hopper_bulk, "
                           "triton_tc, triton_fp32, triton_portable, reference"):
            resolve_moe("toy", torch.device("cpu"), torch.float32)
        assert "toy" not in _cli_choices("moe_backend")
    finally:
        MOE_REGISTRY.register("toy")(toy_moe[0])  # the fixture unregisters it


def test_a_registered_persistent_backend_is_built_by_name_and_a_config_choice():
    built = []

    @PERSISTENT_BACKENDS.register("toy")
    class Toy(PersistentBackend):
        takes_cached_pages = False

        def bind_cache(self, binding):
            pass

        def run_quantum(self, req):
            raise NotImplementedError

        @classmethod
        def for_core(cls, core, checkpoint=None):
            built.append((core, checkpoint))
            return cls()

    core = SimpleNamespace(model=SimpleNamespace(has_static_decode=True), runner=SimpleNamespace(device="cpu"))
    try:
        assert isinstance(create_backend("toy", core, "ckpt"), Toy) and built == [(core, "ckpt")]
        assert not backend_takes_cached_pages("toy")
        assert isinstance(create_backend("auto", core), EagerBackend)  # auto_rank None: never picked by auto
        assert AppConfig(persistent_backend="toy").persistent_backend == "toy"
        assert "toy" in _cli_choices("persistent_backend")
    finally:
        PERSISTENT_BACKENDS.unregister("toy")
    with pytest.raises(ValidationError, match="persistent_backend"):
        AppConfig(persistent_backend="toy")
    from replicas.persistent.contract import UnsupportedConfigurationError

    with pytest.raises(UnsupportedConfigurationError,
                       match="unknown persistent backend 'toy'; choose from auto, eager, cuda_graph, mk1"):
        create_backend("toy", core)


def test_a_registered_model_family_is_picked_by_model_type_and_checked_at_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy"}))
    with pytest.raises(ValueError, match="unsupported model_type 'toy'; supported: llama, gpt_oss"):
        model_class(tmp_path)

    @MODELS.register("toy")
    class Toy(CausalLM):
        has_static_decode = True  # but no decode_static(): the check says so

    try:
        assert model_class(tmp_path) is Toy
        toy = Toy()
        with pytest.raises(TypeError, match=r"Toy does not implement the model protocol.*no from_pretrained\(\).*"
                           r"config has no vocab_size.*decode_static\(\) is missing.*ops is not a DecodeOps"):
            check_model(toy)
    finally:
        MODELS.unregister("toy")


def test_the_builtin_models_pass_the_protocol_check(core):
    assert check_model(core.model) is core.model
    assert core.model.has_static_decode and core.model.max_decode_graph_batch is None
    assert core.model.warm_up_prompt_lengths(64) == ()
