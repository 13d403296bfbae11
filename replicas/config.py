"""Engine configuration (one per replica; pydantic so it validates and pickles)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.models.loader import DEFAULT_MODEL


class EngineConfig(BaseModel):
    """Everything a replica's engine needs to start."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(DEFAULT_MODEL, description="Embedded alias, path to a .gguf file, or HF checkpoint directory.")
    served_model_name: str | None = Field(None, description="Name clients use in `model`; defaults to `model`.")
    device: str = Field("auto", description="torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:N.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV cache dtype; auto = float32 on CPU, bfloat16 on GPU."
    )
    max_model_len: int = Field(2048, ge=16, description="Longest prompt + output, in tokens.")
    num_kv_blocks: int | None = Field(
        None, ge=1, description=f"KV pages ({PAGE_SIZE} tokens each); default: 4 x max_model_len worth."
    )
    max_num_seqs: int = Field(256, ge=1, description="Most requests decoded together on the standard lane "
                              "(vLLM's default); decode CUDA graphs are captured up to it.")
    max_num_batched_tokens: int = Field(4096, ge=16, description="Most new tokens per standard-lane step.")
    enable_prefix_caching: bool = Field(
        True, description="Share KV pages of equal prompt prefixes (hash-chained full pages) on the standard lane "
        "and on the persistent lane where its backend takes cached pages (every backend but mk1, whose envelope "
        "requires it off)."
    )
    enable_chunked_prefill: bool = Field(
        True, description="Split long prompts across steps under max_num_batched_tokens, mixed with decodes."
    )
    enforce_eager: bool = Field(
        False, description="Never replay CUDA graphs for standard-lane decode steps (vLLM's flag of that name)."
    )
    cuda_graph_batch_sizes: tuple[int, ...] = Field(
        (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256),
        description="Batch-size buckets of the standard lane's decode CUDA graphs (GPU only; those above "
                    "max_num_seqs are dropped; each is captured the first time a step needs it).",
    )
    prefill_kernels: bool = Field(
        True, description="On CUDA, run prefill and mixed steps through the Triton prefill attention and grouped "
        "MXFP4 MoE kernels (replicas/kernels/prefill_attention.py, moe_grouped_gemm.py); False keeps the torch "
        "reference path (attention per sequence, each routed expert dequantized), e.g. to compare the two.",
    )
    torch_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's own).")
    progress: bool = Field(True, description="Show progress bars while loading.")

    @model_validator(mode="after")
    def _check_blocks(self) -> EngineConfig:
        if self.num_kv_blocks is not None and self.num_kv_blocks * PAGE_SIZE < self.max_model_len:
            raise ValueError(
                f"num_kv_blocks={self.num_kv_blocks} holds {self.num_kv_blocks * PAGE_SIZE} tokens, "
                f"less than max_model_len={self.max_model_len}"
            )
        return self

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.resolved_device().type == "cpu" else torch.bfloat16
        return getattr(torch, self.dtype)

    def resolved_num_kv_blocks(self) -> int:
        return self.num_kv_blocks or 4 * -(-self.max_model_len // PAGE_SIZE)
