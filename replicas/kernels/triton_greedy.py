"""One greedy decode step's epilogue in one launch: argmax over the vocabulary plus the quantum's bookkeeping.

Inside a captured quantum (:mod:`replicas.persistent.cuda_graph`) each step ends
with: the argmax of the logits, the token stored at the step's slot, the count
of tokens that count advanced while no stop id was seen, the stop-id check, and
the pending token and position advanced. In torch that is eight small launches
per step (a reduction, copies, comparisons); here it is one. Every program takes
the arg-max of one block of logits (the first index among equal maxima, as
``torch.argmax``) and stores it; the last program to arrive (a global arrival
counter: :mod:`replicas.kernels.grid_sync`) picks the best block, does the
bookkeeping and resets the counter for the next launch. NaN logits: ``torch.argmax`` returns the first NaN,
this kernel ignores NaNs (the step's output is meaningless either way; the token stays in the vocabulary).

The state it reads and writes is :class:`~replicas.persistent.cuda_graph.QuantumBuffers`'
layout: ``state = [token, position, alive, stop_ids (MAX_STOP), ...]`` and ``out = [out_tokens (Q), count]``
(int64). The torch ops it replaces are
:func:`replicas.persistent.cuda_graph.greedy_step_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.kernels.grid_sync import arrive, gpu_fence

BLOCK = 2048
"""Logits per program: gpt-oss's 201,088-token vocabulary is 99 programs, SmolLM2's 49,152 is 24."""


@triton.jit
def _greedy_step_kernel(logits_ptr, V, part_v_ptr, part_i_ptr, counter_ptr, state_ptr, out_ptr, step,
                        MAX_STOP: tl.constexpr, Q: tl.constexpr, BLOCK: tl.constexpr, PP: tl.constexpr,
                        FENCE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best = tl.argmax(v, 0, tie_break_left=True)
    tl.store(part_v_ptr + pid, tl.max(v, 0))
    tl.store(part_i_ptr + pid, pid.to(tl.int64) * BLOCK + best)
    if arrive(counter_ptr, FENCE):  # the last program: every block's arg-max is in
        gpu_fence(FENCE)
        p = tl.arange(0, PP)
        p_ok = p < tl.num_programs(0)
        vals = tl.load(part_v_ptr + p, mask=p_ok, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(part_i_ptr + p, mask=p_ok, other=0, cache_modifier=".cg")
        first = tl.argmax(vals, 0, tie_break_left=True)  # blocks are in vocabulary order: the first index wins
        tok = tl.sum(tl.where(p == first, idxs, 0), 0)
        stops = tl.load(state_ptr + 3 + tl.arange(0, MAX_STOP))
        alive = tl.load(state_ptr + 2)
        position = tl.load(state_ptr + 1)
        count = tl.load(out_ptr + Q)
        count = tl.where(step == 0, 0, count)  # the quantum's first step starts the count
        tl.debug_barrier()  # every thread has read the state before any thread writes it
        hit = tl.sum((stops == tok).to(tl.int32), 0) > 0
        tl.store(out_ptr + step, tok)
        tl.store(out_ptr + Q, count + alive)
        tl.store(state_ptr + 2, tl.where(hit, 0, alive))
        tl.store(state_ptr, tok)
        tl.store(state_ptr + 1, position + 1)
        tl.store(counter_ptr, 0)  # ready for the next launch (CUDA-graph replays)


def greedy_step(logits: torch.Tensor, state: torch.Tensor, out: torch.Tensor, step: int, max_stop: int,
                workspace: dict) -> None:
    """Greedy step epilogue in one launch: ``tok = argmax(logits)``; ``out[step] = tok``; ``out[-1]`` (the
    count) ``+= alive`` (starting from 0 at ``step == 0``); ``alive = 0`` if ``tok`` is a stop id;
    ``state[0] = tok``; ``state[1] += 1``.

    Args:
        logits: ``[1, V]`` (or ``[V]``) contiguous, any float dtype.
        state: int64 ``[>= 3 + max_stop]``: token, position, alive (0/1), stop ids (padded with -1).
        out: int64 ``[Q + 1]``: the quantum's tokens, then the count.
        step: this step's index in the quantum (``0 <= step < Q``).
        workspace: dict reused across calls for the per-block partials and the arrival counter (keeps a
            captured graph's buffers fixed; the counter is back at 0 after every launch). One decode stream
            per workspace.

    Raises:
        ValueError: more than one row, a step out of range, non-int64 / non-contiguous buffers, or a
            ``max_stop`` that is not a power of two.
    """
    v = logits.shape[-1]
    q = out.numel() - 1
    if logits.numel() != v or not logits.is_contiguous() or not 0 <= step < q:
        raise ValueError(f"greedy_step: expected one contiguous row and 0 <= step < {q}, got "
                         f"{tuple(logits.shape)} and step {step}")
    if state.dtype != torch.int64 or out.dtype != torch.int64 or not (state.is_contiguous() and out.is_contiguous()):
        raise ValueError("greedy_step: state and out must be contiguous int64")
    if max_stop & (max_stop - 1) or state.numel() < 3 + max_stop:
        raise ValueError(f"greedy_step: max_stop must be a power of two that fits the state, got {max_stop}")
    programs = triton.cdiv(v, BLOCK)
    key = (programs, logits.device)
    if workspace.get("greedy_key") != key:
        workspace.update(greedy_key=key,
                         greedy_v=torch.empty(programs, dtype=torch.float32, device=logits.device),
                         greedy_i=torch.empty(programs, dtype=torch.int64, device=logits.device),
                         greedy_counter=torch.zeros(1, dtype=torch.int32, device=logits.device))
    _greedy_step_kernel[(programs,)](
        logits, v, workspace["greedy_v"], workspace["greedy_i"], workspace["greedy_counter"], state, out, step,
        MAX_STOP=max_stop, Q=q, BLOCK=BLOCK, PP=triton.next_power_of_2(programs),
        FENCE=logits.is_cuda and not torch.version.hip, num_warps=4,
    )
