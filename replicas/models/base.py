"""What a model family is: the :class:`CausalLM` base class, and :data:`MODELS`, the registry of families by
``config.json`` ``model_type``.

A family registers its class in its own file (``@MODELS.register("llama")``);
:mod:`replicas.models.registry` imports the families, picks one per checkpoint and checks the loaded model
against the protocol once (:func:`check_model`), so the engine, the decode graphs and the persistent
backends read the capabilities below as plain attributes, never probing for them.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from replicas.kernels.decode_ops import DecodeOps
from replicas.registry import Registry

CONFIG_FIELDS = ("model_type", "vocab_size", "num_layers", "num_kv_heads", "head_dim", "max_position_embeddings",
                 "eos_token_ids")
"""Fields every family's ``config`` has (the KV cache, the engine and the persistent lane read them)."""


class CausalLM(nn.Module):
    """A decoder-only model over the paged KV cache: the protocol every family implements.

    Required (checked once at load by :func:`check_model`):

    - ``config_class``: its config type (``from_dir(path)`` parses ``config.json``); an instance's
      ``config`` has at least :data:`CONFIG_FIELDS`;
    - ``from_pretrained(path, dtype, device, progress)`` and ``from_config(cfg, dtype, device, seed)``
      (random weights) class methods;
    - ``forward(input_ids [T], meta, kv_planes) -> [B, vocab]`` fp32 logits of each sequence's last new token;
    - ``use_ops(ops) -> self``: run on the :class:`~replicas.kernels.decode_ops.DecodeOps` resolved at load
      (``ops`` holds them afterwards).

    Capabilities (attributes with defaults, read before and after construction):

    Attributes:
        name: the registered ``model_type`` (set by :data:`MODELS`).
        uses_moe: the model has experts; its ``DecodeOps`` are built with a MoE backend.
        has_static_decode: it has ``decode_static(token [B], position [B], block_table, kv_planes) -> [B, vocab]``,
            a step with static shapes that CUDA graphs capture (the standard lane's decode graphs and the
            ``cuda_graph`` persistent backend need it).
        max_decode_graph_batch: the largest standard-lane decode-graph batch its kernels allow (None: no limit).
    """

    name: ClassVar[str] = "abstract"
    config_class: ClassVar[type]
    uses_moe: ClassVar[bool] = False
    has_static_decode: ClassVar[bool] = False
    max_decode_graph_batch: int | None = None
    ops: DecodeOps

    def warm_up_prompt_lengths(self, max_tokens: int) -> tuple[int, ...]:
        """Prompt lengths (at most ``max_tokens``) that :meth:`replicas.engine.LLMEngine.warm_up` runs besides
        its own, to reach every kernel variant of this model (default: none)."""
        return ()


MODELS: Registry[type[CausalLM]] = Registry("model_type", CausalLM,
                                            modules=("replicas.models.llama", "replicas.models.gpt_oss"))
"""The model families we serve, by ``config.json`` ``model_type``, in registration order: each module listed
registers its class when imported (on the registry's first lookup); a new family is its own file plus its
module here."""

_REQUIRED = ("from_pretrained", "from_config", "forward", "use_ops")


def check_model(model: CausalLM) -> CausalLM:
    """Check a loaded ``model`` against the :class:`CausalLM` protocol once; returns it.

    Raises:
        TypeError: a required method or config field is missing, ``decode_static`` disagrees with
            ``has_static_decode``, or ``ops`` is not a :class:`DecodeOps`.
    """
    cls = type(model)
    problems = [f"no {m}()" for m in _REQUIRED if not callable(getattr(cls, m, None))]
    if not isinstance(getattr(cls, "config_class", None), type):
        problems.append("no config_class")
    cfg = getattr(model, "config", None)
    problems += [f"config has no {f}" for f in CONFIG_FIELDS if not hasattr(cfg, f)]
    if callable(getattr(cls, "decode_static", None)) != cls.has_static_decode:
        problems.append(f"has_static_decode is {cls.has_static_decode} but decode_static() is "
                        f"{'defined' if cls.has_static_decode is False else 'missing'}")
    if not isinstance(getattr(model, "ops", None), DecodeOps):
        problems.append("ops is not a DecodeOps")
    if problems:
        raise TypeError(f"{cls.__name__} does not implement the model protocol (replicas.models.base.CausalLM): "
                        + "; ".join(problems))
    return model

