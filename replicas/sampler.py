"""Token sampling: logprobs, bans, penalties, greedy, temperature, top-k, top-p, min-p, seeds.

One call picks one token per row of a ``[B, vocab]`` fp32 logits tensor, each
row with its own :class:`~replicas.request.SamplingParams`, optional
``torch.Generator`` and token history (:class:`SamplingRow`).

Pipeline (vLLM's order), per row, in :func:`sample_rows`:

1. **logprobs** (rows with ``params.logprobs`` set): ``log_softmax`` of the
   *raw* model logits, before anything below (vLLM's default
   ``logprobs_mode="raw_logprobs"``); the sampled token's value plus the
   ``k = params.logprobs`` most likely ``(token_id, logprob)``.
2. **bans**: ``banned_token_ids`` are set to ``-inf`` (the engine bans EOS and
   stop ids while fewer than ``min_tokens`` were generated:
   :func:`replicas.stops.stop_token_set`), and so is every token outside
   ``allowed_token_mask`` (a structured output's grammar,
   :mod:`replicas.structured_output`).
3. **repetition penalty** over prompt + output tokens (CTRL, Keskar et al.
   2019; HF ``RepetitionPenaltyLogitsProcessor``).
4. **presence / frequency penalties** over output tokens only (OpenAI API).
5. **greedy** rows (``params.is_greedy``) take ``argmax`` here; they never
   touch an RNG.
6. **temperature** ``logits / T``.
7. **top-k**, then **top-p** (nucleus, Holtzman et al. 2019) on the top-k
   renormalised distribution.
8. **min-p** (Nguyen et al. 2024) on the temperature-scaled, filtered
   distribution.
9. **draw** with the row's generator (the global RNG when None): :func:`draw`, the exponential race that
   ``torch.multinomial`` runs for one sample, without its two host syncs.

Rows that need none of steps 2-9 (greedy, no bans, no penalties) take the
fast path: one ``argmax`` over the whole batch. Steps 2-8 are batched over the
rows that use them (scatter/gather masks, one sort); only the draw in step 9
loops over rows that carry their own generator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from replicas.messages import TokenLogprobs
from replicas.request import SamplingParams

_NEG_INF = float("-inf")


def generator_seed(seed: int) -> int:
    """The 64-bit seed a request's ``torch.Generator`` gets for the request's ``seed`` (any int64).

    ``seed`` is read as a 64-bit pattern (two's complement for negatives) and
    mixed with SplitMix64's finalizer (Steele, Lea and Flood 2014, "Fast
    splittable pseudorandom number generators"; the mixing step of Java's
    ``SplittableRandom``), a bijection on 64-bit integers in which every output
    bit depends on every input bit. Torch's CPU generator (a Mersenne Twister)
    keeps only the low 32 bits of its seed, so without the mix seeds equal
    modulo 2**32 (``-1``, ``2**63 - 1``, ``2**64 - 1``) would give the same
    stream; with it nearby and structured seeds give unrelated streams. On
    CUDA (Philox) all 64 bits are used and distinct seeds never collide; on
    CPU two seeds collide with probability 2**-32.
    """
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


_MASK64 = (1 << 64) - 1


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded generator for ``params.seed`` (None when unseeded or greedy); see :func:`generator_seed`."""
    if params.seed is None or params.is_greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(generator_seed(params.seed))
    return gen


@dataclass
class SamplingRow:
    """Everything the sampler needs about one row of the logits.

    Attributes:
        params: the request's sampling parameters.
        generator: the request's seeded RNG (see :func:`make_generator`), or
            None for the global RNG. Unused by greedy rows.
        prompt_token_ids: the prompt (repetition penalty only).
        output_token_ids: tokens generated so far (all penalties).
        banned_token_ids: ids masked to ``-inf`` before anything else; ids
            outside ``[0, vocab)`` are ignored (they cannot be sampled anyway).
        allowed_token_mask: bool ``[vocab]`` (the logits' device): only True tokens may be
            picked (a grammar's mask); None allows every token.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    banned_token_ids: frozenset[int] = frozenset()
    allowed_token_mask: torch.Tensor | None = None

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.params.repetition_penalty != 1.0 and bool(self.prompt_token_ids or self.output_token_ids)

    @property
    def uses_additive_penalties(self) -> bool:
        p = self.params
        return bool(p.presence_penalty or p.frequency_penalty) and bool(self.output_token_ids)

    @property
    def needs_processing(self) -> bool:
        """False when plain ``argmax`` of the raw logits is this row's answer (the fast path)."""
        return (
            not self.params.is_greedy
            or bool(self.banned_token_ids)
            or self.allowed_token_mask is not None
            or self.uses_repetition_penalty
            or self.uses_additive_penalties
        )


@dataclass
class SamplerOutput:
    """What :func:`sample_rows` picked.

    Attributes:
        token_ids: one token id per row.
        logprobs: per row a :class:`TokenLogprobs` (from the raw logits), or
            None for rows whose ``params.logprobs`` is None.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a list, or a CPU tensor) as a ``dtype`` tensor on ``device``. On a GPU the copy goes through
    pinned memory and does not wait: ``torch.tensor(..., device=...)``, ``.to(device)`` of a pageable tensor
    and indexing a GPU tensor with a Python list all copy and then wait for every kernel queued on the stream
    before them (the forward just launched), which stalls the host for the whole step."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def device_index(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """``values`` as an int64 ``[N]`` index tensor on ``device``, without a wait (:func:`to_device`)."""
    return to_device(values, torch.long, device)


# --- batched building blocks ---------------------------------------------------------------
#
# All take and return ``[R, vocab]`` float tensors (R rows of the subset that
# uses the feature) and never modify their input.


def _index_pairs(seqs: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_idx, token_idx)`` int64 ``[N]`` tensors: row ``j`` paired with each token of ``seqs[j]``."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    toks = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    return to_device(rows, torch.long, device), to_device(toks, torch.long, device)


def apply_bans(logits: torch.Tensor, banned: Sequence[Iterable[int]]) -> torch.Tensor:
    """Set ``logits[j, t] = -inf`` for every ``t`` in ``banned[j]`` (ids outside the vocab are skipped)."""
    vocab = logits.shape[-1]
    rows, toks = _index_pairs([[t for t in b if 0 <= t < vocab] for b in banned], logits.device)
    return logits.index_put((rows, toks), torch.full((), _NEG_INF, dtype=logits.dtype, device=logits.device))


def apply_repetition_penalty(
    logits: torch.Tensor, token_ids: Sequence[Sequence[int]], penalties: Sequence[float]
) -> torch.Tensor:
    """CTRL's repetition penalty over the tokens already seen (prompt and output).

    For every token ``t`` in ``token_ids[j]`` (counted once however often it
    appears), with ``θ = penalties[j]``::

        logit[j, t] = logit[j, t] / θ   if logit[j, t] > 0
                      logit[j, t] * θ   otherwise

    so ``θ > 1`` always makes a seen token less likely, whatever its sign.

    Sources: Keskar et al. 2019, "CTRL: A Conditional Transformer Language
    Model for Controllable Generation", Sec. 4.1 (penalised sampling; the
    sign-aware form is HF ``RepetitionPenaltyLogitsProcessor``'s, which vLLM
    follows).
    """
    rows, toks = _index_pairs(token_ids, logits.device)
    seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    seen[rows, toks] = True
    theta = to_device(penalties, logits.dtype, logits.device).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / theta, logits * theta)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    output_token_ids: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> torch.Tensor:
    """OpenAI's additive penalties over the tokens generated so far.

    With ``c[t]`` the number of times ``t`` occurs in ``output_token_ids[j]``::

        logit[j, t] -= frequency[j] * c[t] + presence[j] * (c[t] > 0)

    Prompt tokens are not counted. Positive values discourage repetition,
    negative ones encourage it (the API accepts ``[-2, 2]``).

    Source: OpenAI API reference / "Parameter details" for
    ``presence_penalty`` and ``frequency_penalty``
    (``mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence``).
    """
    rows, toks = _index_pairs(output_token_ids, logits.device)
    counts = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
    counts.index_put_((rows, toks), torch.ones(rows.shape, dtype=logits.dtype, device=logits.device), accumulate=True)
    freq = to_device(frequency, logits.dtype, logits.device).unsqueeze(1)
    pres = to_device(presence, logits.dtype, logits.device).unsqueeze(1)
    return logits - (freq * counts + pres * (counts > 0).to(logits.dtype))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int | None] | None, top_p: Sequence[float] | None
) -> torch.Tensor:
    """Mask with ``-inf`` every token outside row ``j``'s top-k set, then outside its top-p nucleus.

    Args:
        logits: ``[R, vocab]`` float (already temperature-scaled).
        top_k: per row ``k`` (None, 0 or ``>= vocab`` disables), or None for no top-k at all.
        top_p: per row ``p`` in ``(0, 1]`` (1 disables), or None for no top-p at all.

    top-k keeps every token whose logit is ``>=`` the k-th largest (ties with
    the k-th are kept). top-p (Holtzman et al. 2019, "The Curious Case of
    Neural Text Degeneration", nucleus sampling) works on the distribution
    renormalised over the top-k survivors: sorted by probability, a token is
    dropped when the mass of the tokens before it already reaches ``p``, so
    the smallest prefix with mass ``>= p`` is kept (always at least one token).
    """
    rows, vocab = logits.shape
    ks = [k if k and k < vocab else vocab for k in top_k] if top_k is not None else None
    ps = [p if p < 1.0 else float("inf") for p in top_p] if top_p is not None else None
    if ks is not None and all(k == vocab for k in ks):
        ks = None
    if ps is not None and all(p == float("inf") for p in ps):
        ps = None
    if ks is None and ps is None:
        return logits
    device = logits.device
    if ps is None:  # top-k alone: a partial top-k is cheaper than a full sort
        assert ks is not None
        kmax = max(k for k in ks if k < vocab)  # rows without top-k do not widen the partial sort
        values = torch.topk(logits, kmax, dim=-1).values
        kth = values.gather(1, device_index([min(k, kmax) - 1 for k in ks], device).unsqueeze(1))
        off = to_device([k == vocab for k in ks], torch.bool, device).unsqueeze(1)
        kth = kth.masked_fill(off, _NEG_INF)
        return logits.masked_fill(logits < kth, _NEG_INF)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    if ks is not None:
        kth = sorted_logits.gather(1, device_index([k - 1 for k in ks], device).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    probs = sorted_logits.softmax(-1)
    p = to_device(ps, probs.dtype, device).unsqueeze(1)
    drop = (probs.cumsum(-1) - probs) >= p
    drop[:, 0] = False  # the most likely token stays, even for a p that rounds to 0 in this dtype
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the most likely one.

    With ``P = softmax(logits[j])`` (the temperature-scaled distribution)::

        keep t  iff  P[t] >= min_p[j] * max(P)

    The ratio ``P[t] / max(P)`` does not change when the distribution is
    renormalised over a subset containing the top token, so applying this
    after top-k / top-p keeps exactly the tokens min-p alone would keep among
    their survivors. The top token always survives.

    Source: Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for
    Creative and Coherent LLM Outputs" (arXiv:2407.01082); HF ``MinPLogitsWarper``.
    """
    probs = logits.softmax(-1)
    threshold = to_device(min_p, probs.dtype, logits.device).unsqueeze(1) * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Mask one row ``[vocab]`` outside the top-k set and the top-p nucleus (see :func:`apply_top_k_top_p`)."""
    return apply_top_k_top_p(logits.unsqueeze(0), [top_k], [top_p]).squeeze(0)


# --- the sampler ------------------------------------------------------------------------------


def _select(x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """``x[positions]`` without a copy when ``positions`` is every row in order."""
    if len(positions) == x.shape[0] and positions == list(range(x.shape[0])):
        return x
    return x.index_select(0, device_index(positions, x.device))


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs``, drawn from it: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per entry.

    ``min_j q_j / p_j`` picks ``j`` with probability ``p_j`` (the exponential race, the Gumbel-max trick with
    ``exp`` applied). This is the computation ``torch.multinomial(probs, 1, generator=generator)`` runs
    (PyTorch's ``multinomial_out`` fast path for one sample, ``aten/src/ATen/native/Distributions.cpp``),
    in the same order and with the same draws from ``generator``, so the tokens are the same bit for bit
    (``tests/replicas/test_sampler_params.py`` checks it on the CPU; CUDA dispatches to the same function). What it leaves out are multinomial's checks of ``probs``
    (no inf/nan/negative entry, no all-zero row), which read two scalars to the host and so wait for the
    GPU: the sampler's probabilities come from a softmax over at least one finite logit, so they hold.

    Args:
        probs: ``[R, vocab]`` or ``[vocab]`` float probabilities (rows need not be normalised).
        generator: the RNG (None: the global one of ``probs``'s device).

    Returns:
        ``[R]`` int64 token ids (a 0-d tensor for a 1-D ``probs``) on ``probs.device``.
    """
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax(-1)


def _process_and_pick(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Steps 2-9 of the module docstring for rows that need them.

    Args:
        logits: ``[R, vocab]`` fp32, a private copy (never the caller's tensor).
        rows: the ``R`` rows.

    Returns:
        ``[R]`` int64 token ids on ``logits.device``.
    """
    vocab = logits.shape[-1]
    x = logits
    # 2. a grammar's mask (structured outputs), then bans
    grammar_only: dict[int, torch.Tensor] = {}
    for j, r in enumerate(rows):
        if r.allowed_token_mask is not None:
            x[j] = x[j].masked_fill(~r.allowed_token_mask[:vocab], _NEG_INF)
            if r.banned_token_ids:
                grammar_only[j] = x[j].clone()
    ban = [j for j, r in enumerate(rows) if r.banned_token_ids]
    if ban:
        for j in ban:
            if sum(1 for t in rows[j].banned_token_ids if 0 <= t < vocab) >= vocab:
                raise ValueError("every token of the vocabulary is banned; nothing can be sampled")
        at = device_index(ban, x.device)
        x[at] = apply_bans(x[at], [rows[j].banned_token_ids for j in ban])
    for j, row in grammar_only.items():  # the bans (min_tokens) took the grammar's last tokens: the grammar wins
        if bool(torch.isinf(x[j]).all()):
            x[j] = row
    # 3. repetition penalty (prompt + output)
    rep = [j for j, r in enumerate(rows) if r.uses_repetition_penalty]
    if rep:
        seen = [list(rows[j].prompt_token_ids) + list(rows[j].output_token_ids) for j in rep]
        at = device_index(rep, x.device)
        x[at] = apply_repetition_penalty(x[at], seen, [rows[j].params.repetition_penalty for j in rep])
    # 4. presence / frequency (output only)
    add = [j for j, r in enumerate(rows) if r.uses_additive_penalties]
    if add:
        at = device_index(add, x.device)
        x[at] = apply_presence_frequency_penalties(
            x[at],
            [rows[j].output_token_ids for j in add],
            [rows[j].params.presence_penalty for j in add],
            [rows[j].params.frequency_penalty for j in add],
        )
    # 5. greedy rows: argmax of the banned / penalised logits
    tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
    greedy = [j for j, r in enumerate(rows) if r.params.is_greedy]
    if greedy:
        tokens[device_index(greedy, x.device)] = _select(x, greedy).argmax(-1)
    rand = [j for j, r in enumerate(rows) if not r.params.is_greedy]
    if not rand:
        return tokens
    params = [rows[j].params for j in rand]
    # 6. temperature
    temps = to_device([p.temperature for p in params], x.dtype, x.device).unsqueeze(1)
    y = _select(x, rand) / temps
    # 7. top-k, then top-p
    use_k = any(p.top_k and p.top_k < vocab for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    if use_k or use_p:
        y = apply_top_k_top_p(
            y, [p.top_k for p in params] if use_k else None, [p.top_p for p in params] if use_p else None
        )
    # 8. min-p
    mp = [i for i, p in enumerate(params) if p.min_p > 0]
    if mp:
        at = device_index(mp, y.device)
        y[at] = apply_min_p(y[at], [params[i].min_p for i in mp])
    # 9. draw: unseeded rows in one call on the global RNG, seeded rows one by one
    probs = y.softmax(-1)
    drawn = torch.empty(len(rand), dtype=torch.long, device=x.device)
    unseeded = [i for i, j in enumerate(rand) if rows[j].generator is None]
    if unseeded:
        drawn[device_index(unseeded, x.device)] = draw(_select(probs, unseeded))
    for i, j in enumerate(rand):
        gen = rows[j].generator
        if gen is not None:
            drawn[i] = draw(probs[i], gen)
    tokens[device_index(rand, x.device)] = drawn
    return tokens


def _logprob_tensors(logits: torch.Tensor, rows: list[SamplingRow],
                     tokens: torch.Tensor) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """The device half of :func:`_logprobs`: ``(want, ks, tensors)`` with ``want`` the rows that asked for
    logprobs, ``ks`` their top counts and ``tensors`` ``[chosen_ids [W] int64, chosen [W] fp32]`` plus, when
    some ``k > 0``, ``[top values [W, max k] fp32, top ids [W, max k] int64]`` (nothing read to the host)."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not want:
        return want, [], []
    lp = torch.log_softmax(_select(logits, want).float(), dim=-1)
    index = device_index(want, tokens.device)
    chosen_ids = tokens.index_select(0, index)
    chosen = lp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    ks = [min(rows[i].params.logprobs or 0, lp.shape[-1]) for i in want]
    tensors = [chosen_ids, chosen]
    if max(ks) > 0:
        values, indices = torch.topk(lp, max(ks), dim=-1)
        tensors += [values, indices]
    return want, ks, tensors


def _logprob_entries(num_rows: int, want: list[int], ks: list[int],
                     host: list[torch.Tensor]) -> list[TokenLogprobs | None]:
    """The host half of :func:`_logprobs`: per row a :class:`TokenLogprobs` or None, from
    :func:`_logprob_tensors`'s tensors (read here)."""
    out: list[TokenLogprobs | None] = [None] * num_rows
    if not want:
        return out
    chosen_ids, chosen = host[0].tolist(), host[1].tolist()
    top_v: list[list[float]] = [[] for _ in want]
    top_i: list[list[int]] = [[] for _ in want]
    if len(host) > 2:
        top_v, top_i = host[2].tolist(), host[3].tolist()
    for n, (i, tok) in enumerate(zip(want, chosen_ids, strict=True)):
        k = ks[n]
        out[i] = TokenLogprobs(
            token_id=tok, logprob=chosen[n], top=list(zip(top_i[n][:k], top_v[n][:k], strict=True))
        )
    return out


def _logprobs(logits: torch.Tensor, rows: list[SamplingRow], tokens: torch.Tensor) -> list[TokenLogprobs | None]:
    """Raw-logit logprobs for the rows that asked for them (one batched log_softmax and top-k)."""
    want, ks, tensors = _logprob_tensors(logits, rows, tokens)
    return _logprob_entries(len(rows), want, ks, tensors)


def prompt_token_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Logprobs of known next tokens (a prompt's), from the raw logits before each.

    Args:
        logits: ``[R, vocab]`` float logits; row ``j`` is the model's prediction
            for the token after position ``j`` of a prompt chunk.
        targets: ``R`` token ids, the prompt tokens that actually follow.
        k: how many of the most likely tokens to add per row (``0..20``).

    Returns:
        ``R`` :class:`TokenLogprobs` (``log_softmax`` of the raw logits, as the
        sampled tokens' logprobs), most likely first in ``top``.
    """
    if logits.shape[0] != len(targets):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(targets)} target tokens")
    if not len(targets):
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(targets), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    k = min(k, lp.shape[-1])
    top_v: list[list[float]] = [[] for _ in targets]
    top_i: list[list[int]] = [[] for _ in targets]
    if k > 0:
        values, indices = torch.topk(lp, k, dim=-1)
        top_v, top_i = values.tolist(), indices.tolist()
    return [TokenLogprobs(token_id=int(t), logprob=c, top=list(zip(i, v, strict=True)))
            for t, c, i, v in zip(targets, chosen, top_i, top_v, strict=True)]


def _pick(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Steps 1-9 of the module docstring but the logprobs: ``[B]`` int64 picks on ``logits.device``, queued,
    not read. Raises ``ValueError`` as :func:`sample_rows`."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
    tokens = logits.argmax(-1)  # the fast path, for every row at once
    slow = [i for i, r in enumerate(rows) if r.needs_processing]
    if slow:
        at = device_index(slow, logits.device)
        x = logits.index_select(0, at).float()  # a private copy
        tokens[at] = _process_and_pick(x, [rows[i] for i in slow])
    return tokens


def sample_rows(logits: torch.Tensor, rows: list[SamplingRow],
                before_read: Callable[[], None] | None = None) -> SamplerOutput:
    """Pick one token per row (see the module docstring for the pipeline and its sources).

    Args:
        logits: ``[B, vocab]`` float logits from the model (fp32 expected); not modified.
        rows: ``B`` rows, ``rows[i]`` describing ``logits[i]``.
        before_read: called with no arguments once the picks are queued on the device and before they are
            read to the host (the engine's blocking wait, ``EngineConfig.blocking_sync``).

    Returns:
        :class:`SamplerOutput` with ``B`` token ids and ``B`` logprob entries.

    Raises:
        ValueError: ``logits`` is not ``[len(rows), vocab]``, or a row bans the whole vocabulary.
    """
    tokens = _pick(logits, rows)
    if before_read is not None:
        before_read()
    logprobs = _logprobs(logits, rows, tokens)
    return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)


class QueuedPicks:
    """One step's picks and logprobs, queued on the device and not read yet (:func:`queue_picks`; the
    engine's async scheduling reads them a step later).

    Attributes:
        tokens: ``[B]`` int64 picks on the logits' device, for the next step's inputs.
    """

    def __init__(self, tokens: torch.Tensor, num_rows: int, want: list[int], ks: list[int],
                 host: list[torch.Tensor], ready):
        self.tokens = tokens
        self._num_rows, self._want, self._ks, self._host, self._ready = num_rows, want, ks, host, ready

    def read(self) -> SamplerOutput:
        """Wait for the picks and their copies to the host (only them, not work queued after them) and return
        them: the same :class:`SamplerOutput` :func:`sample_rows` returns for the same logits and rows."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens, rest = self._host[0], self._host[1:]
        return SamplerOutput(token_ids=tokens.tolist(),
                             logprobs=_logprob_entries(self._num_rows, self._want, self._ks, rest))


def queue_picks(logits: torch.Tensor, rows: list[SamplingRow], blocking: bool = False) -> QueuedPicks:
    """:func:`sample_rows` without the read: queue the picks and the logprobs on the device, then their
    copies to the host (into pinned buffers, behind an event, on a GPU), so that work queued after this
    call (the next step's forward) does not delay :meth:`QueuedPicks.read`.

    Args:
        logits: ``[B, vocab]`` float logits (fp32 expected); not modified.
        rows: ``B`` rows, ``rows[i]`` describing ``logits[i]``; each row's generator advances now, in call order.
        blocking: on a GPU, :meth:`QueuedPicks.read` sleeps on a blocking CUDA event instead of spinning
            (``EngineConfig.blocking_sync``).

    Returns:
        :class:`QueuedPicks`.

    Raises:
        ValueError: ``logits`` is not ``[len(rows), vocab]``, or a row bans the whole vocabulary.
    """
    tokens = _pick(logits, rows)
    want, ks, tensors = _logprob_tensors(logits, rows, tokens)
    ready = None
    host = [tokens, *tensors]
    if tokens.device.type == "cuda":  # transport only: the same values, read without a stream-wide sync
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in host]
        ready = torch.cuda.Event(blocking=blocking)
        ready.record()
    return QueuedPicks(tokens, len(rows), want, ks, host, ready)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Pick one token per row, without token history (the original entry point).

    A thin wrapper over :func:`sample_rows` with empty prompt/output histories
    and no bans, so penalties have nothing to act on; use :func:`sample_rows`
    for penalties, ``min_tokens`` bans and logprobs.

    Args:
        logits: ``[B, vocab]`` fp32.
        params: ``B`` sampling parameters.
        generators: ``B`` generators (None: the global RNG).

    Returns:
        ``B`` token ids.
    """
    rows = [SamplingRow(p, g, (), ()) for p, g in zip(params, generators, strict=True)]
    return sample_rows(logits, rows).token_ids
