"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Logits are ``[B, vocab]`` fp32; one ``SamplingParams`` (and optional
``torch.Generator``) per row. Greedy rows take ``argmax`` and never touch an RNG.
"""

from __future__ import annotations

import torch

from replicas.request import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded generator for ``params.seed`` (None when unseeded or greedy)."""
    if params.seed is None or params.is_greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Mask ``logits`` ``[vocab]`` outside the top-k set and the top-p nucleus with -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop tokens whose preceding cumulative mass already reaches top_p (keeps at least one)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Pick one token per row.

    Args:
        logits: ``[B, vocab]`` fp32.
        params: ``B`` sampling parameters.
        generators: ``B`` generators (None: the global RNG).

    Returns:
        ``B`` token ids.
    """
    out: list[int] = []
    greedy = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.is_greedy:
            out.append(greedy[i])
            continue
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out
