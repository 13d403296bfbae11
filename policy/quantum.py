"""Quantum sizing: how many tokens one persistent-decoder launch may emit.

Source: the seed's rule, docs/design.md "Quantum size" and "Persistent decode
contract" (``QuantumRequest.max_tokens``). Pure: no torch, no ray.
"""

from __future__ import annotations

MAX_QUANTUM_TOKENS = 8
"""Most tokens one native launch emits (the seed's quantum cap)."""


def quantum_size(
    remaining_output_tokens: int,
    max_model_len: int,
    committed_tokens: int,
    num_eos_ids: int = 1,
    device_checks_stop_set: bool = True,
    max_quantum: int = MAX_QUANTUM_TOKENS,
) -> int:
    """Return the size (in tokens) of the next quantum.

    ``min(max_quantum, remaining_output_tokens, max_model_len - committed_tokens - 1)``,
    clamped at 0. The seed's native kernel knows a single EOS id, so with more
    than one EOS id and a backend that does not check a stop-id set on device,
    the quantum drops to at most 1 (the host checks stops after every token).

    Args:
        remaining_output_tokens: output tokens still allowed for the request.
        max_model_len: the model's context length in tokens.
        committed_tokens: tokens whose KV is already in the cache.
        num_eos_ids: how many EOS/stop token ids are configured.
        device_checks_stop_set: the backend checks a set of stop ids on device.
        max_quantum: the cap, ``MAX_QUANTUM_TOKENS`` by default.

    Returns:
        Tokens to request, in ``[0, max_quantum]``; 0 means nothing can be produced.

    Raises:
        ValueError: if ``max_quantum < 1`` or any count is negative.
    """
    if max_quantum < 1:
        raise ValueError(f"max_quantum must be >= 1, got {max_quantum}")
    counts = {
        "remaining_output_tokens": remaining_output_tokens,
        "max_model_len": max_model_len,
        "committed_tokens": committed_tokens,
        "num_eos_ids": num_eos_ids,
    }
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    context_room = max_model_len - committed_tokens - 1
    size = min(max_quantum, remaining_output_tokens, context_room)
    if num_eos_ids > 1 and not device_checks_stop_set:
        size = min(size, 1)
    return max(size, 0)
