"""``eager`` persistent backend: the reference implementation of the contract.

Runs on any device with plain torch: each step of the quantum is one forward of
the replica's own model over the bound KV planes (no second cache), greedy
argmax, and a check against the whole stop-id set. CPU ``serve run`` uses it.
"""

from __future__ import annotations

import torch

from replicas.kernels.paged_attention import PAGE_SIZE, AttentionMetadata
from replicas.persistent.checkpoint import check_checkpoint_dir
from replicas.persistent.contract import (
    PERSISTENT_BACKENDS,
    BackendLaunchError,
    CacheBinding,
    PersistentBackend,
    QuantumRequest,
    QuantumResult,
    check_launchable,
)


@PERSISTENT_BACKENDS.register("eager")
class EagerBackend(PersistentBackend):
    """Step-by-step greedy decode over the bound cache.

    Args:
        model: ``forward(input_ids [T], meta, kv_planes) -> [B, vocab]`` logits.
        device: where the step inputs live.
    """

    name = "eager"
    checks_stop_set_on_device = True
    auto_rank = 1  # after cuda_graph: any device, any model

    @classmethod
    def for_core(cls, core, checkpoint: str | None = None) -> EagerBackend:
        """Decodes with the engine's own weights; a checkpoint, when given, must pass
        :func:`~replicas.persistent.checkpoint.check_checkpoint_dir` (loading persistent weights from it comes
        with the GPT-OSS checkpoint work).

        Raises:
            CheckpointError: bad checkpoint directory."""
        if checkpoint:
            check_checkpoint_dir(checkpoint)
        return cls(core.model, core.runner.device)

    def __init__(self, model: torch.nn.Module, device: torch.device | str):
        self.model = model
        self.device = torch.device(device)
        self._planes: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def bind_cache(self, binding: CacheBinding) -> None:
        self._planes = binding.typed_planes()

    @torch.inference_mode()
    def run_quantum(self, req: QuantumRequest) -> QuantumResult:
        check_launchable(req, self._planes is not None)
        stop_ids = set(req.stop_token_ids)
        block_map = req.full_block_map.to(self.device, torch.long)
        pending, committed = req.pending_token, req.committed_kv_length
        emitted: list[int] = []
        finish = "max_tokens"
        try:
            for _ in range(req.max_tokens):
                slot = block_map[committed // PAGE_SIZE] * PAGE_SIZE + committed % PAGE_SIZE
                meta = AttentionMetadata(
                    positions=torch.tensor([committed], device=self.device),
                    slot_mapping=slot.view(1),
                    query_start=[0, 1],
                    context_lens=[committed + 1],
                    block_tables=[block_map],
                )
                logits = self.model(torch.tensor([pending], device=self.device), meta, self._planes)
                pending = int(logits[0].argmax())
                committed += 1
                emitted.append(pending)
                if pending in stop_ids:
                    finish = "eos"
                    break
                if committed >= req.max_sequence_length:
                    finish = "max_sequence_length"
                    break
                if req.cancellation_flag is not None and req.cancellation_flag.is_set():
                    finish = "cancelled"
                    break
        except Exception as exc:  # after the first forward the cache has changed: terminal
            raise BackendLaunchError(f"eager quantum failed: {exc}") from exc
        return QuantumResult(finish, emitted, committed, pending, len(emitted))
