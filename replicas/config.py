"""Engine configuration (one per replica; pydantic so it validates and pickles)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replicas.kernels.moe.backends import MOE_REGISTRY
from replicas.kernels.page import PAGE_SIZE
from replicas.models import DEFAULT_MODEL
from replicas.registry import OneOf

if TYPE_CHECKING:
    import torch

MoEBackendName = Annotated[str, OneOf(MOE_REGISTRY, fixed=("auto",))]
"""``auto`` or a registered decode MoE backend (:data:`replicas.kernels.moe.backends.MOE_REGISTRY`, the one
registry; checked when the config is validated, so the choices are the registry's at that time)."""


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
                    "max_num_seqs are dropped; all captured at load by the warm-up, see warmup, else each the first "
                    "time a step needs it).",
    )
    prefill_kernels: bool = Field(
        True, description="On a GPU, run prefill, mixed and large standard-lane steps through the Triton prefill "
        "attention and the MoE's grouped MXFP4 GEMMs (replicas/kernels/prefill_attention.py, "
        "replicas/kernels/moe/grouped_gemm.py); false keeps the torch reference attention and dequantizes each "
        "routed expert, e.g. to compare the two. Resolved at load, shown in /debug/stats.",
    )
    batch_invariant: bool = Field(
        False, description="On a GPU, run every op through row-exact kernels (replicas/kernels/row_exact_gemm.py, "
        "the grouped MoE GEMMs at a fixed M-block height, decode attention at a fixed split count) and keep "
        "decode rows and prompt tokens in separate forwards, so that a greedy request's tokens depend on its "
        "prompt alone: the same on both lanes, alone or among other requests, prefilled whole or in chunks "
        "(docs/exactness.md, with what it costs). Needs prefill_kernels. The CPU path (fp32 references) is "
        "batch-independent already and ignores it. Resolved at load, shown in /debug/stats.",
    )
    torch_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's own).")
    progress: bool = Field(True, description="Show progress bars while loading.")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="auto: load the checkpoint's weights; dummy: build the model from its config.json "
        "alone with random weights (MXFP4 experts packed as in the checkpoints), for benchmarks without the "
        "weights (vLLM's --load-format dummy). The tokenizer still comes from the model directory if it has one.",
    )
    # Kernel choices: resolved once at load (replicas.kernels.decode_ops.DecodeOps.build), shown in /debug/stats.
    pdl: bool = Field(
        True, description="Launch the decode kernels with programmatic dependent launch where the GPU supports "
        "it (NVIDIA sm_90+): a kernel's weight loads overlap the previous kernel's tail.",
    )
    moe_backend: MoEBackendName = Field(
        "auto", description="MoE decode kernels of models with experts (GPT-OSS): auto picks the first that runs "
        "here of hopper_bulk (NVIDIA sm_90+, bf16), triton_tc (NVIDIA), triton_fp32 (NVIDIA, fp32 models), "
        "triton_portable (any Triton GPU, e.g. ROCm), reference (CPU). A named backend that cannot run here "
        "fails the load. docs/kernels.md lists them.",
    )
    moe_repack: bool = Field(
        True, description="Repack the experts at load into the bit layout the hopper_bulk kernels decode in "
        "fewer instructions (ignored by other backends).",
    )
    moe_tiles: dict[str, int] = Field(
        default_factory=dict, description="Tile arguments for the MoE decode kernels (e.g. {\"down_pairs\": 1}); "
        "keys must be the chosen backend's (replicas.kernels.moe.TILE_KEYS). Empty: the kernels' defaults.",
    )
    pipeline_quanta: bool = Field(
        True, description="Persistent lane: launch quantum k+1 behind quantum k before reading k, on backends "
        "that support it (cuda_graph), so the GPU never waits for the host between quanta.",
    )
    colocated_persistent_steps: int = Field(
        1, ge=1, le=64, description="Co-located engines (colocated=true), the scheduling policy between the lanes: "
        "while both hold work, the engine loop runs one standard step, then up to this many persistent steps "
        "(each the persistent request's prefill or one quantum), then the next standard step. So a standard step "
        "waits for at most this many persistent steps, and a persistent step for at most one standard step. "
        "1 alternates them; more favours the persistent stream's time per token over the standard streams'. "
        "Ignored by a single-lane engine.",
    )
    warmup: bool = Field(
        True, description="On a GPU, at load: capture every standard-lane decode-graph bucket and run throwaway "
        "prefills and decode steps (prompts of 16 to 1,024 tokens, 1 and 8 sequences; every grouped MoE GEMM tile), so the first requests do "
        "not pay Triton compilation and graph capture (vLLM captures its graphs at start likewise). Ignored on CPU.",
    )
    fused_greedy_epilogue: bool = Field(
        True, description="cuda_graph persistent backend: each step's argmax, stop check and bookkeeping in "
        "one Triton launch instead of the torch ops.",
    )

    blocking_sync: bool = Field(
        False, description="Standard lane on a GPU: the engine thread waits for each step's forward and token "
        "picks on a blocking CUDA event recorded after the picks are queued (it sleeps, leaving the core and the "
        "GIL to the actor's output path) instead of spinning in the read of the sampled tokens (CUDA's default "
        "for one context per process). The "
        "persistent lane always spins: its quanta are latency-bound. Ignored on CPU.",
    )
    async_scheduling: bool = Field(
        False, description="Standard lane: launch the next decode step before reading the previous step's "
        "sampled tokens (its decode rows take their input tokens from the device), so the host's scheduling "
        "and launch work overlaps the GPU's forward. With batch_invariant every chunk is the same as without "
        "it, bit for bit; otherwise a row that ends on a stop id rides one step ahead (its result dropped) and "
        "that step's other rows may differ in their last bits, as with any change of batch. Only batches where that is safe run ahead (LLMEngine._plan_ahead: no penalties, "
        "structured output or min_tokens ban, nothing waiting, no prefill chunk, pages free); the rest take "
        "the synchronous step. With blocking_sync the read of the previous tokens sleeps on an event. Off "
        "until measured on a GPU (decision 0031).",
    )

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
        import torch  # here, not at the top: Serve's ingress and lane wrappers import this module without torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.float32 if self.resolved_device().type == "cpu" else torch.bfloat16
        return getattr(torch, self.dtype)

    def kernel_options(self) -> dict:
        """The kernel settings :func:`replicas.models.registry.load_model` passes to
        :meth:`replicas.kernels.decode_ops.DecodeOps.build`."""
        return {"pdl": self.pdl, "moe_backend": self.moe_backend, "moe_repack": self.moe_repack,
                "moe_tiles": dict(self.moe_tiles), "prefill_kernels": self.prefill_kernels,
                "batch_invariant": self.batch_invariant}

    def resolved_num_kv_blocks(self) -> int:
        return self.num_kv_blocks or 4 * -(-self.max_model_len // PAGE_SIZE)
