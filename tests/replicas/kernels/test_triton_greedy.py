"""The fused greedy-step epilogue (:mod:`replicas.kernels.triton_greedy`) against the torch ops it replaces.

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``, set by this
folder's conftest), which runs the programs one after another, so the
last-arriving program is the last one; run with CUDA (this file, on the GPU
machine) the programs race for the arrival counter. Logits are random normal with planted
ties across blocks (the first index must win, as ``torch.argmax``).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from replicas.kernels.triton_greedy import BLOCK, greedy_step  # noqa: E402
from replicas.persistent.cuda_graph import MAX_STOP_IDS, greedy_step_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
Q = 8


def _state(token: int, position: int, stops: list[int]) -> torch.Tensor:
    state = torch.full((3 + MAX_STOP_IDS + 4,), -1, dtype=torch.long)
    state[0], state[1], state[2] = token, position, 1
    state[3:3 + len(stops)] = torch.tensor(stops, dtype=torch.long)
    state[3 + MAX_STOP_IDS:] = torch.arange(4)  # a block table the epilogue must not touch
    return state.to(DEVICE)


@pytest.mark.parametrize("vocab,dtype", [(5 * BLOCK + 77, torch.float32), (1000, torch.float32),
                                         (3 * BLOCK, torch.bfloat16)])
def test_quantum_of_steps_matches_torch_ops(vocab, dtype):
    """Eight steps, each on fresh logits; a stop id sampled at step 3 stops the count there; the argmax has
    ties across blocks (the first index wins)."""
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randn(Q, vocab, generator=g).to(dtype)
    winners = []
    for s in range(Q):
        top = rows[s].max() + 1
        a, b = sorted(torch.randperm(vocab, generator=g)[:2].tolist())
        rows[s, b] = top  # a tie: the lower index a must win
        rows[s, a] = top
        winners.append(a)
    stops = [winners[3], 10**9]
    state_k, out_k = _state(7, 100, stops), torch.full((Q + 1,), 55, dtype=torch.long, device=DEVICE)
    state_r, out_r = state_k.clone(), out_k.clone()
    ws: dict = {}
    logits = rows.to(DEVICE)
    for s in range(Q):
        greedy_step(logits[s:s + 1].contiguous(), state_k, out_k, s, MAX_STOP_IDS, ws)
        greedy_step_reference(logits[s:s + 1], state_r, out_r, s, MAX_STOP_IDS)
        assert int(ws["greedy_counter"]) == 0  # reset for the next launch
    assert out_k.tolist() == out_r.tolist()
    assert state_k.tolist() == state_r.tolist()
    assert out_k[:Q].tolist() == winners
    assert int(out_k[Q]) == 4  # steps 0..3 count; the stop at step 3 is the last
    assert state_k[0] == winners[-1] and state_k[1] == 100 + Q and state_k[2] == 0


def test_count_restarts_at_step_zero_and_alive_carries():
    """A second quantum: its step 0 starts the count again; with ``alive`` already 0 nothing counts."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 3000, generator=g).to(DEVICE)
    state, out = _state(1, 5, []), torch.zeros(Q + 1, dtype=torch.long, device=DEVICE)
    ws: dict = {}
    greedy_step(logits, state, out, 0, MAX_STOP_IDS, ws)
    greedy_step(logits, state, out, 1, MAX_STOP_IDS, ws)
    assert int(out[Q]) == 2
    greedy_step(logits, state, out, 0, MAX_STOP_IDS, ws)
    assert int(out[Q]) == 1
    state[2] = 0
    greedy_step(logits, state, out, 0, MAX_STOP_IDS, ws)
    assert int(out[Q]) == 0 and int(state[1]) == 5 + 4


def test_bad_arguments_are_refused():
    logits = torch.randn(2, 100, device=DEVICE)
    state, out = _state(1, 5, []), torch.zeros(Q + 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="one contiguous row"):
        greedy_step(logits, state, out, 0, MAX_STOP_IDS, {})
    with pytest.raises(ValueError, match="step"):
        greedy_step(logits[:1], state, out, Q, MAX_STOP_IDS, {})
    with pytest.raises(ValueError, match="int64"):
        greedy_step(logits[:1], state.int(), out, 0, MAX_STOP_IDS, {})
    with pytest.raises(ValueError, match="power of two"):
        greedy_step(logits[:1], state, out, 0, 12, {})
