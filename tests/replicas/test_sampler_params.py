"""The sampler's full parameter set: bans, penalties, min-p, top-k/top-p, logprobs, seeds.

Hand-made logits check each parameter's exact arithmetic and that it changes
what is sampled (every test fails if its parameter were ignored); a hypothesis
property checks bans / top-k / top-p / min-p together against a plain per-row
reference; two tests run on the real SmolLM2 model.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import replicas.sampler as sampler_mod
from replicas.engine import LLMEngine
from replicas.request import Request, SamplingParams
from replicas.sampler import (
    SamplerOutput,
    SamplingRow,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    apply_top_k_top_p,
    draw,
    make_generator,
    sample,
    sample_rows,
)
from tests.replicas.conftest import PROMPTS, chat_ids, run_standard, tokens_of

NEG_INF = float("-inf")


def _row(params: SamplingParams, prompt=(), output=(), banned=(), generator=None) -> SamplingRow:
    return SamplingRow(params, generator, list(prompt), list(output), frozenset(banned))


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def _pick(logits: list[float], row: SamplingRow) -> int:
    return sample_rows(torch.tensor([logits]), [row]).token_ids[0]


def _log(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def _draws(logits: list[float], params: SamplingParams, n: int = 2000, seed: int = 0, **row_kw) -> Counter:
    """``n`` draws from one row (one shared seeded generator, batched as ``n`` identical rows)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.tensor([logits]).expand(n, -1)
    rows = [_row(params, generator=gen, **row_kw)] * n
    return Counter(sample_rows(x, rows).token_ids)


# --- repetition penalty ------------------------------------------------------------------------


def test_repetition_penalty_exact_values():
    """Seen positive logits are divided, seen negative ones multiplied, unseen ones untouched; duplicates count once."""
    x = torch.tensor([[2.0, -1.0, 0.5, -3.0, 0.0]])
    out = apply_repetition_penalty(x, [[0, 1, 1, 1, 4]], [2.0])
    assert out.tolist() == [[1.0, -2.0, 0.5, -3.0, 0.0]]
    assert x.tolist() == [[2.0, -1.0, 0.5, -3.0, 0.0]]  # input untouched
    # below 1 it rewards repetition, in the mirrored direction
    assert apply_repetition_penalty(x, [[0, 1]], [0.5]).tolist() == [[4.0, -0.5, 0.5, -3.0, 0.0]]


def test_repetition_penalty_moves_positive_and_negative_logits_down_in_sample_rows():
    # positive: seen token 0 (2.0 -> 1.0) falls below unseen token 1 (1.5)
    assert _pick([2.0, 1.5, 0.0], _row(_greedy())) == 0
    assert _pick([2.0, 1.5, 0.0], _row(_greedy(repetition_penalty=2.0), prompt=[0])) == 1
    # negative: seen token 0 (-1.0 -> -2.0) falls below unseen token 1 (-1.5); dividing would raise it to -0.5
    assert _pick([-1.0, -1.5, -9.0], _row(_greedy(repetition_penalty=2.0), output=[0])) == 1
    # prompt and output both count
    assert _pick([2.0, 1.5, 1.4], _row(_greedy(repetition_penalty=2.0), prompt=[0], output=[1])) == 2


def test_repetition_penalty_exact_distribution_through_sample_rows():
    """Seeded draws equal draws from softmax of the hand-computed penalised logits (bit-exact arithmetic)."""
    logits = [2.0, -1.0, 0.5, -3.0, 1.0]
    expected = [1.0, -2.0, 0.5, -3.0, 1.0]  # rep 2 over tokens {0, 1}
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    _assert_draws_follow(logits, expected, params, prompt=[0], output=[1, 1])


def _assert_draws_follow(logits, expected, params, n=300, **row_kw):
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    probs = torch.tensor(expected).softmax(-1)
    x = torch.tensor([logits])
    got = [sample_rows(x, [_row(params, generator=gen_a, **row_kw)]).token_ids[0] for _ in range(n)]
    want = [int(torch.multinomial(probs, 1, generator=gen_b)) for _ in range(n)]
    assert got == want
    unpenalised = torch.tensor(logits).softmax(-1)
    gen_c = torch.Generator().manual_seed(5)
    assert got != [int(torch.multinomial(unpenalised, 1, generator=gen_c)) for _ in range(n)]


@given(rows=st.integers(1, 6), vocab=st.integers(2, 2000), seed=st.integers(0, 2**31 - 1),
       masked=st.floats(0.0, 0.9))
@settings(max_examples=60, deadline=None)
def test_draw_is_torch_multinomial_bit_for_bit(rows, vocab, seed, masked):
    """The sampler's sync-free draw picks what ``torch.multinomial(probs, 1)`` picks from the same RNG state:
    per-row generators, a batch on the global RNG, and rows with masked (zero-probability) tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[torch.rand(rows, vocab, generator=g) < masked] = float("-inf")
    logits[:, seed % vocab] = 0.0  # one finite logit per row at least
    probs = logits.softmax(-1)
    for r in range(rows):
        a, b = torch.Generator().manual_seed(seed + r), torch.Generator().manual_seed(seed + r)
        picks = [int(draw(probs[r], a)) for _ in range(5)]
        assert picks == [int(torch.multinomial(probs[r], 1, generator=b)) for _ in range(5)]
        assert all(probs[r, t] > 0 for t in picks)
    torch.manual_seed(seed)
    mine = draw(probs)
    torch.manual_seed(seed)
    assert torch.equal(mine, torch.multinomial(probs, 1).squeeze(1))


# --- presence / frequency penalties ------------------------------------------------------------


def test_presence_frequency_exact_arithmetic_with_counts():
    x = torch.zeros(1, 5)
    out = apply_presence_frequency_penalties(x, [[1, 1, 1, 2]], presence=[0.5], frequency=[0.25])
    # token 1: count 3 -> 0.25*3 + 0.5 = 1.25; token 2: count 1 -> 0.75; others untouched
    assert out.tolist() == [[0.0, -1.25, -0.75, 0.0, 0.0]]
    neg = apply_presence_frequency_penalties(x, [[3, 3]], presence=[-0.5], frequency=[-1.0])
    assert neg.tolist() == [[0.0, 0.0, 0.0, 2.5, 0.0]]  # negative values reward repetition


def test_presence_frequency_count_output_tokens_only_in_sample_rows():
    logits = [0.0, 1.0, 0.9]
    # frequency scales with the count: 0.06 * 2 = 0.12 pushes token 1 (0.88) below 0.9, 0.06 * 1 does not
    assert _pick(logits, _row(_greedy(frequency_penalty=0.06), output=[1, 1])) == 2
    assert _pick(logits, _row(_greedy(frequency_penalty=0.06), output=[1])) == 1
    # presence does not: 0.06 once, however often the token appeared
    assert _pick(logits, _row(_greedy(presence_penalty=0.06), output=[1, 1, 1])) == 1
    assert _pick(logits, _row(_greedy(presence_penalty=0.15), output=[1])) == 2
    # prompt tokens are not penalised
    assert _pick(logits, _row(_greedy(presence_penalty=2.0, frequency_penalty=2.0), prompt=[1, 1, 1])) == 1


def test_presence_frequency_exact_distribution_through_sample_rows():
    logits = [0.0, 1.0, 0.5, 2.0]
    # output [3, 3, 1]: token 3 -> 2 - (0.5*2 + 0.25) = 0.75; token 1 -> 1 - (0.5 + 0.25) = 0.25
    expected = [0.0, 0.25, 0.5, 0.75]
    params = SamplingParams(temperature=1.0, presence_penalty=0.25, frequency_penalty=0.5)
    _assert_draws_follow(logits, expected, params, prompt=[2, 2], output=[3, 3, 1])


def test_greedy_rows_apply_penalties_before_argmax():
    logits = [3.0, 2.9, 0.0, -1.0]
    assert _pick(logits, _row(_greedy(), output=[0])) == 0
    assert _pick(logits, _row(_greedy(presence_penalty=2.0), output=[0])) == 1
    assert _pick(logits, _row(_greedy(frequency_penalty=2.0), output=[0, 1, 0, 1])) == 2  # -1.0, -1.1 < 0.0
    assert _pick(logits, _row(_greedy(repetition_penalty=1.5), prompt=[0])) == 1  # 3.0 / 1.5 = 2.0
    # top_k == 1 is greedy too, with penalties
    assert _pick(logits, _row(SamplingParams(temperature=1.0, top_k=1, presence_penalty=2.0), output=[0])) == 1


# --- min-p ---------------------------------------------------------------------------------------

MIN_P_PROBS = [0.4, 0.2, 0.1, 0.09, 0.09, 0.06, 0.06]


def test_min_p_removes_exactly_the_tokens_below_the_threshold():
    logits = _log(MIN_P_PROBS)
    # threshold 0.24 * 0.4 = 0.096: keeps 0.4, 0.2, 0.1; drops 0.09 and 0.06 (30% of the mass)
    seen = _draws(logits, SamplingParams(temperature=1.0, min_p=0.24))
    assert set(seen) == {0, 1, 2}
    without = _draws(logits, SamplingParams(temperature=1.0))
    assert set(without) == set(range(7))  # the same draws without min-p reach the dropped tokens


def test_min_p_uses_the_temperature_scaled_distribution():
    logits = _log(MIN_P_PROBS)
    # T=2 flattens: p3 / p0 = sqrt(0.225) ~ 0.47 >= 0.24, so 0.09 survives (0.06: sqrt(0.15) ~ 0.39 too)
    assert set(_draws(logits, SamplingParams(temperature=2.0, min_p=0.24))) == set(range(7))
    # T=0.5 sharpens: p1 / p0 = 0.25 survives, p2 / p0 = 0.0625 does not
    assert set(_draws(logits, SamplingParams(temperature=0.5, min_p=0.24))) == {0, 1}


# --- bans ----------------------------------------------------------------------------------------


def test_banned_tokens_are_never_sampled_even_with_huge_logits():
    logits = [1e4, 9e3, 0.0, 0.0, 0.0]
    banned = {0, 1, 99, -1}  # out-of-vocabulary ids are ignored
    params = SamplingParams(temperature=1.0)
    assert set(_draws(logits, params, banned=banned)) == {2, 3, 4}
    assert set(_draws(logits, params)) == {0}  # non-vacuous: without the ban token 0 always wins
    assert _pick(logits, _row(_greedy(), banned={0})) == 1
    assert _pick(logits, _row(SamplingParams(temperature=1.0, top_k=1), banned={0, 1})) == 2
    # bans come before top-k: top_k=1 over the banned logits keeps the best allowed token
    assert set(_draws(logits, SamplingParams(temperature=3.0, top_k=2), banned={0})) == {1}


def test_banning_the_whole_vocabulary_is_an_error():
    with pytest.raises(ValueError, match="banned"):
        _pick([1.0, 2.0], _row(_greedy(), banned={0, 1}))


def test_stop_token_set_is_stop_ids_and_eos_unless_ignored():
    from replicas.stops import stop_token_set

    p = SamplingParams(stop_token_ids=(7, 8))
    assert stop_token_set(p, {2}) == {2, 7, 8}
    ignore = SamplingParams(stop_token_ids=(7,), ignore_eos=True)
    assert stop_token_set(ignore, {2}) == {7}  # EOS is no stop when ignored
    assert stop_token_set(SamplingParams(ignore_eos=True), {2}) == frozenset()


# --- top-k / top-p --------------------------------------------------------------------------------


def test_top_k_1_equals_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=g)
    params = SamplingParams(temperature=1.3, top_k=1, seed=1)
    rows = [_row(params, generator=make_generator(params)) for _ in range(16)]
    assert sample_rows(logits, rows).token_ids == logits.argmax(-1).tolist()
    # the same through the filter itself: only the argmax survives top-k=1
    kept = apply_top_k_top_p(logits, [1] * 16, None) > NEG_INF
    assert kept.sum(-1).tolist() == [1] * 16
    assert kept.float().argmax(-1).tolist() == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_draws():
    logits = _log([0.3, 0.25, 0.2, 0.15, 0.1])
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=2))) == {0, 1}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.6))) == {0, 1, 2}  # 0.55 < 0.6
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.5))) == {0, 1}  # 0.4 < 0.5 of 0.75
    assert set(_draws(logits, SamplingParams(temperature=1.0))) == set(range(5))


def test_batched_top_k_top_p_mixed_rows_match_one_row_at_a_time():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g) * 3
    ks = [None, 5, 0, 39, 40, 2]
    ps = [0.5, 1.0, 0.9, 0.2, 1.0, 0.7]
    batched = apply_top_k_top_p(logits, ks, ps)
    for i in range(6):
        one = apply_top_k_top_p(logits[i : i + 1], [ks[i]], [ps[i]])
        assert torch.equal(batched[i : i + 1], one), i
    only_k = apply_top_k_top_p(logits, ks, None)  # the partial-top-k path
    for i in range(6):
        one = apply_top_k_top_p(logits[i : i + 1], [ks[i]], [1.0])
        assert torch.equal(only_k[i : i + 1], one), i


# --- logprobs ------------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits_sorted_and_of_length_k():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 30, generator=g) * 2
    raw = torch.log_softmax(logits, -1)
    sampled = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.3, presence_penalty=1.0, logprobs=5, seed=3)
    rows = [
        _row(sampled, prompt=[1, 2], output=[3, 3], banned={int(logits[0].argmax())}, generator=make_generator(sampled)),
        _row(_greedy(logprobs=20, frequency_penalty=2.0), output=[int(logits[1].argmax())]),
        _row(_greedy()),
    ]
    out = sample_rows(logits, rows)
    assert isinstance(out, SamplerOutput) and out.logprobs[2] is None
    for i, k in ((0, 5), (1, 20)):
        lp = out.logprobs[i]
        tok = out.token_ids[i]
        assert lp is not None and lp.token_id == tok
        assert lp.logprob == pytest.approx(raw[i, tok].item(), abs=1e-6)  # raw: before bans / penalties / temperature
        assert len(lp.top) == k
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        top_ids = torch.topk(raw[i], k).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
        for t, v in lp.top:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-6)
    # the penalised greedy row did not pick the raw argmax, and its logprob is still the raw one
    assert out.token_ids[1] != int(logits[1].argmax())
    assert out.logprobs[1].logprob < out.logprobs[1].top[0][1]


def test_logprobs_zero_gives_an_empty_top_list():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = sample_rows(logits, [_row(_greedy(logprobs=0))])
    lp = out.logprobs[0]
    assert lp is not None and lp.top == [] and lp.token_id == 2
    assert lp.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())


# --- batch plumbing ---------------------------------------------------------------------------------


def test_plain_greedy_rows_take_the_fast_path(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("fast-path rows went through the slow path")

    monkeypatch.setattr(sampler_mod, "_process_and_pick", boom)
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(0))
    rows = [
        _row(_greedy(logprobs=2), prompt=[1], output=[2]),
        _row(_greedy(repetition_penalty=1.5)),  # no tokens seen yet: nothing to penalise
        _row(_greedy(presence_penalty=1.0), prompt=[3]),  # prompt only: presence has no output to count
        _row(SamplingParams(temperature=1.0, top_k=1)),
    ]
    out = sample_rows(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs[0] is not None and out.logprobs[1] is None


def test_rows_follow_their_own_params_and_input_is_untouched():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0], [0.0, 0.0, 5.0], [0.0, 0.0, 5.0]])
    before = logits.clone()
    rows = [
        _row(_greedy(presence_penalty=2.0), output=[0]),
        _row(_greedy()),
        _row(_greedy(), banned={2}),
        _row(SamplingParams(temperature=1.0, top_p=1e-6, seed=1), generator=torch.Generator().manual_seed(1)),
    ]
    assert sample_rows(logits, rows).token_ids == [1, 0, 0, 2]
    assert torch.equal(logits, before)


def test_legacy_sample_wrapper_matches_sample_rows():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=t, seed=s) for t, s in ((0.0, None), (1.0, 4), (0.5, 9), (2.0, 4), (0.0, 1))]
    a = sample(logits, params, [make_generator(p) for p in params])
    b = sample_rows(logits, [_row(p, generator=make_generator(p)) for p in params]).token_ids
    assert a == b


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="logits"):
        sample_rows(torch.zeros(2, 5), [_row(_greedy())])


# --- property: bans, top-k, top-p, min-p hold for random logits and params ------------------


@st.composite
def _case(draw):
    vocab = draw(st.integers(2, 12))
    n_rows = draw(st.integers(1, 4))
    logits = draw(
        st.lists(
            st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=vocab, max_size=vocab),
            min_size=n_rows, max_size=n_rows,
        )
    )
    tokens = st.lists(st.integers(0, vocab - 1), max_size=8)
    rows = []
    for _ in range(n_rows):
        params = SamplingParams(
            temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 3.0))),
            top_k=draw(st.one_of(st.none(), st.integers(0, vocab + 2))),
            top_p=draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0))),
            min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
            presence_penalty=draw(st.one_of(st.just(0.0), st.floats(-2, 2))),
            frequency_penalty=draw(st.one_of(st.just(0.0), st.floats(-2, 2))),
            repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.5, 2.0))),
            logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
            seed=draw(st.integers(0, 2**31)),
        )
        banned = draw(st.frozensets(st.integers(0, vocab - 1), max_size=vocab - 1))
        rows.append(SamplingRow(params, make_generator(params), draw(tokens), draw(tokens), banned))
    return torch.tensor(logits, dtype=torch.float32), rows


def _reference_logits(raw: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Steps 2-4 one token at a time (bans, repetition, presence/frequency), fp32 like the sampler."""
    x = raw.clone()
    for t in row.banned_token_ids:
        x[t] = NEG_INF
    theta = torch.tensor(row.params.repetition_penalty, dtype=torch.float32)
    for t in set(row.prompt_token_ids) | set(row.output_token_ids):
        x[t] = x[t] / theta if x[t] > 0 else x[t] * theta
    p = row.params
    for t, c in Counter(row.output_token_ids).items():
        penalty = torch.tensor(p.frequency_penalty, dtype=torch.float32) * c + torch.tensor(p.presence_penalty, dtype=torch.float32)
        x[t] = x[t] - penalty
    return x


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_property_sampled_token_respects_bans_top_k_top_p_min_p(case):
    logits, rows = case
    vocab = logits.shape[-1]
    out = sample_rows(logits, rows)
    raw_lp = torch.log_softmax(logits, -1).double()
    for i, (row, tok) in enumerate(zip(rows, out.token_ids, strict=True)):
        p = row.params
        assert 0 <= tok < vocab
        assert tok not in row.banned_token_ids
        x = _reference_logits(logits[i], row)
        if p.is_greedy:
            assert x[tok] == x.max(), "greedy picks the argmax of the penalised logits"
        else:
            y = (x / torch.tensor(p.temperature, dtype=torch.float32)).double()
            assert y[tok] > NEG_INF
            if p.top_k and p.top_k < vocab:
                kth = torch.topk(y, p.top_k).values[-1]
                assert y[tok] >= kth, "outside the top-k"
                y = y.masked_fill(y < kth, NEG_INF)
            probs = y.softmax(-1)
            if p.top_p < 1.0:
                above = probs[probs > probs[tok]].sum().item()
                assert above < p.top_p + 1e-4, "outside the top-p nucleus"
            if p.min_p > 0:
                assert probs[tok] >= p.min_p * probs.max() * (1 - 1e-4) - 1e-12, "below min-p"
        if p.logprobs is None:
            assert out.logprobs[i] is None
        else:
            lp = out.logprobs[i]
            assert lp.token_id == tok and lp.logprob == pytest.approx(raw_lp[i, tok].item(), abs=1e-4)
            assert len(lp.top) == min(p.logprobs, vocab)
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


# --- real model ----------------------------------------------------------------------------------


def _decode(core, prompt_ids: list[int], params: SamplingParams, steps: int) -> list[int]:
    """Incremental decode of one request with ``sample_rows`` (penalties see the growing history)."""
    r = Request("sampler-params", list(prompt_ids), params)
    gen = make_generator(params, core.runner.device)
    try:
        for _ in range(steps):
            core.allocator.grow(r.block_table, r.num_tokens)
            n = r.num_new_tokens
            logits = core.runner.execute([(r, n)])
            r.num_computed_tokens += n
            row = SamplingRow(params, gen, r.prompt_token_ids, r.output_token_ids)
            r.output_token_ids.append(sample_rows(logits, [row]).token_ids[0])
    finally:
        core.allocator.release(r.block_table)
    return r.output_token_ids


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_frequency_penalty_breaks_a_repeating_greedy_continuation(core, tokenizer):
    ids = chat_ids(tokenizer, "Repeat after me: la la la la la")
    steps = 24
    plain = _decode(core, ids, _greedy(max_tokens=steps), steps)
    # the decode loop itself is the engine's greedy decode
    engine = tokens_of(run_standard(LLMEngine(core), {"r": (ids, _greedy(max_tokens=steps, ignore_eos=True))})["r"])
    assert plain == engine
    assert _repeats(plain) >= 3, f"the unpenalised continuation should repeat tokens: {tokenizer.decode(plain)!r}"
    penalised = _decode(core, ids, _greedy(max_tokens=steps, frequency_penalty=2.0), steps)
    assert penalised != plain
    assert _repeats(penalised) < _repeats(plain), tokenizer.decode(penalised)


@pytest.mark.parametrize("extra", [{}, {"presence_penalty": 0.5, "top_p": 0.95}])
def test_same_seed_same_tokens_over_20_steps(core, tokenizer, extra):
    ids = chat_ids(tokenizer, PROMPTS[1])
    r = Request("prefill", ids, _greedy())
    core.allocator.grow(r.block_table, r.num_tokens)
    try:
        logits = core.runner.execute([(r, r.num_tokens)])
    finally:
        core.allocator.release(r.block_table)

    def run(seed: int, batch: int = 1) -> list[list[int]]:
        params = SamplingParams(temperature=1.0, seed=seed, **extra)
        gens = [make_generator(params) for _ in range(batch)]
        outs: list[list[int]] = [[] for _ in range(batch)]
        for _ in range(20):
            rows = [SamplingRow(params, gens[b], ids, outs[b]) for b in range(batch)]
            for b, t in enumerate(sample_rows(logits.expand(batch, -1), rows).token_ids):
                outs[b].append(t)
        return outs

    first = run(7)[0]
    assert run(7)[0] == first
    assert run(7, batch=3) == [first] * 3  # batched rows with the same seed draw independently and alike
    assert run(8)[0] != first
    assert len(set(first)) > 1, "temperature 1.0 sampling never left one token"
