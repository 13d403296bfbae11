"""Async scheduling (``EngineConfig.async_scheduling``) on the real engine: the same chunks as the synchronous
step, request for request.

Each test runs one script of ``add_request`` / ``abort`` calls, placed by step-call index, on two engines over
the session model that differ only in ``async_scheduling``, and compares every chunk (token ids, finish
reason, logprobs, prompt logprobs, counts) with ``==``. The CPU forward is not row-exact (a row's logits move
in the last bits with the rows beside it), so equal logprobs also say that the async engine ran exactly the
synchronous engine's batches. The one place where they differ by design: a row that ends on an EOS or stop id
while it is in a step launched ahead rides along in that step (its result dropped), so that step's other
rows may differ from the synchronous run in their last bits. Where a script's synchronous run ends a row
that way, logprob values are left out of the comparison (token ids, the logprobs' token ids, finish reasons
and counts are still compared with ``==``). Every engine must end with its page pool full.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicas.engine import EngineCore, LLMEngine
from replicas.request import SamplingParams
from replicas.scheduler import SchedulerConfig
from replicas.structured_output import StructuredOutput
from tests.replicas.conftest import assert_pool_full

Script = dict[int, list[tuple]]
"""Step-call index -> calls made before that step: ``("add", rid, prompt_ids, params)`` or ``("abort", rid)``."""


def _core(core: EngineCore, async_scheduling: bool, num_kv_blocks: int = 96, max_model_len: int = 256,
          prefix_caching: bool = True) -> EngineCore:
    """A core over the session model's weights with its own KV pool and ``async_scheduling`` set."""
    cfg = core.config.model_copy(update={"num_kv_blocks": num_kv_blocks, "max_model_len": max_model_len,
                                         "async_scheduling": async_scheduling})
    return EngineCore.build(cfg, core.model, core.tokenizer, enable_prefix_caching=prefix_caching,
                            eos_token_ids=core.eos_token_ids)


class _Counted(LLMEngine):
    """The engine with counters of the async path's events (steps launched ahead, rows that ended while a
    step ahead held them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.launched_ahead = self.ended_ahead = 0
        self.ran_ahead: set[str] = set()

    def _launch_ahead(self, prev, plan):
        self.launched_ahead += 1
        self.ran_ahead.update(t.req.request_id for _, t in plan)
        return super()._launch_ahead(prev, plan)

    def _collect(self, prev):
        chunks = super()._collect(prev)
        ahead = self._inflight
        if ahead is not None:
            self.ended_ahead += sum(self._tracked.get(t.req.request_id) is not t for t in ahead.rows)
        return chunks


def _run(core: EngineCore, script: Script, async_scheduling: bool, sched: SchedulerConfig, **core_kw):
    """Run ``script``; returns ``({(request id, index): [chunk fields]}, engine, its core)``. Checks that no
    chunk of a request follows its abort and that the pool is full at the end."""
    eng_core = _core(core, async_scheduling, **core_kw)
    eng = _Counted(eng_core, sched)
    out: dict[tuple[str, int], list[tuple]] = {}
    aborted: set[str] = set()
    step, last = 0, max(script, default=0)
    while step <= last or eng.has_unfinished():
        for call in script.get(step, ()):
            if call[0] == "add":
                eng.add_request(call[1], call[2], call[3])
            else:
                eng.abort(call[1])
                aborted.add(call[1])
        for c in eng.step():
            assert c.request_id not in aborted, f"chunk for {c.request_id} after its abort"
            out.setdefault((c.request_id, c.index), []).append(
                (c.token_ids, c.finish_reason, c.logprobs, c.prompt_logprobs, c.num_output_tokens))
        step += 1
        assert step < 2_000, "engine did not finish"
    assert not eng.has_unfinished() and eng._inflight is None
    assert_pool_full(eng_core)
    return out, eng, eng_core


def _without_logprob_values(chunks: list[tuple]) -> list[tuple]:
    """Chunk fields with each logprob entry reduced to its token ids (chosen and top)."""
    def ids(entries):
        return None if entries is None else [(e.token_id, [i for i, _ in e.top]) if e else None for e in entries]
    return [(tokens, finish, ids(lps), ids(plps), n) for tokens, finish, lps, plps, n in chunks]


def _compare(core, script: Script, sched: SchedulerConfig | None = None, **core_kw):
    sched = sched or SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    want, sync, _ = _run(core, script, False, sched, **core_kw)
    got, eng, _ = _run(core, script, True, sched, **core_kw)
    assert sync.launched_ahead == 0
    if eng.ended_ahead:  # a step ahead carried an ended row: its other rows' logprob values may differ
        want = {k: _without_logprob_values(v) for k, v in want.items()}
        got = {k: _without_logprob_values(v) for k, v in got.items()}
    aborted = {call[1] for calls in script.values() for call in calls if call[0] == "abort"}
    assert got.keys() <= want.keys()
    for key in want:
        if key[0] in aborted:  # the async engine held its last step in flight at the abort: that one is dropped
            n = len(got.get(key, []))
            assert got.get(key, []) == want[key][:n] and n >= len(want[key]) - 1, key
        else:
            assert got[key] == want[key], key
    return want, eng


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 49_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _frequent_tokens(core) -> tuple[int, ...]:
    """Token ids the model picks often from random prompts (as stop ids they end requests mid-batch)."""
    out, _, _ = _run(core, {0: [("add", f"p{i}", _prompt(100 + i, 20),
                                 SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                                for i in range(4)]}, False, SchedulerConfig())
    counts: dict[int, int] = {}
    for chunks in out.values():
        for c in chunks:
            counts[c[0][0]] = counts.get(c[0][0], 0) + 1
    return tuple(sorted(counts, key=counts.get, reverse=True)[:3])


def _mixed_script(stops: tuple[int, ...]) -> Script:
    """Greedy and seeded sampled requests of different prompt lengths and max_tokens, arriving while others
    decode; stop ids that end some mid-batch, ignore_eos ones, n = 2, logprobs and a min_tokens one."""
    greedy = dict(temperature=0.0)
    sampled = dict(temperature=0.9, top_p=0.9, top_k=40, min_p=0.02)
    reqs = [
        (0, "g-stop", 23, SamplingParams(max_tokens=30, stop_token_ids=stops, logprobs=2, **greedy)),
        (0, "s-seed", 9, SamplingParams(max_tokens=25, seed=7, stop_token_ids=stops, logprobs=1, **sampled)),
        (0, "g-eos-ignored", 40, SamplingParams(max_tokens=17, ignore_eos=True, **greedy)),
        (2, "s-n2", 14, SamplingParams(max_tokens=20, seed=3, n=2, stop_token_ids=stops, **sampled)),
        (3, "g-short", 5, SamplingParams(max_tokens=1, **greedy)),
        (5, "s-min", 31, SamplingParams(max_tokens=22, seed=11, min_tokens=6, stop_token_ids=stops,
                                        logprobs=0, **sampled)),
        (9, "g-late", 70, SamplingParams(max_tokens=12, stop_token_ids=stops, ignore_eos=True, **greedy)),
        (9, "s-late", 3, SamplingParams(max_tokens=16, seed=0, temperature=0.7)),
    ]
    script: Script = {}
    for i, (at, rid, n, params) in enumerate(reqs):
        script.setdefault(at, []).append(("add", rid, _prompt(i, n), params))
    return script


def test_async_matches_sync_on_a_mixed_workload(core):
    stops = _frequent_tokens(core)
    want, eng = _compare(core, _mixed_script(stops))
    finishes = [chunks[-1][1] for chunks in want.values()]
    assert "stop" in finishes and "length" in finishes  # some rows ended on a stop id mid-batch
    assert eng.launched_ahead > 10 and eng.ended_ahead > 0  # the async path ran; rows ended while ahead


def test_async_matches_sync_without_prefix_caching_and_chunked_prefill(core):
    stops = _frequent_tokens(core)
    _, eng = _compare(core, _mixed_script(stops),
                      SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=False),
                      prefix_caching=False)
    assert eng.launched_ahead > 0


def test_rows_that_need_host_state_take_the_sync_path(core):
    """Penalties and a structured output beside plain rows: the same chunks (those batches run synchronously);
    once they end, the plain rows run ahead again."""
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    script: Script = {
        0: [("add", "plain", _prompt(1, 12), plain),
            ("add", "seeded", _prompt(2, 18), SamplingParams(max_tokens=24, temperature=0.8, seed=5))],
        3: [("add", "penalty", _prompt(3, 9), SamplingParams(max_tokens=6, temperature=0.0,
                                                              repetition_penalty=1.3, presence_penalty=0.5))],
        4: [("add", "json", _prompt(4, 7), SamplingParams(
            max_tokens=8, temperature=0.0, structured_output=StructuredOutput(schema='{"type": "object"}')))],
        5: [("add", "freq", _prompt(5, 10), SamplingParams(max_tokens=5, temperature=0.7, seed=1,
                                                           frequency_penalty=1.0, prompt_logprobs=2))],
    }
    _, eng = _compare(core, script)
    assert eng.launched_ahead > 0 and {"plain", "seeded"} <= eng.ran_ahead
    assert not {"penalty", "json", "freq"} & eng.ran_ahead


def test_abort_while_a_step_is_in_flight(core):
    """Aborts between steps (the async engine then holds a step with the request in flight): no chunk after
    the abort (checked by the runner), the aborted request's chunks are the synchronous engine's less the
    in-flight one, the other requests' chunks equal the synchronous engine's, and every page comes back."""
    p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    s = SamplingParams(max_tokens=30, temperature=1.0, seed=4, ignore_eos=True)
    script: Script = {
        0: [("add", "a", _prompt(1, 20), p), ("add", "b", _prompt(2, 33), s), ("add", "c", _prompt(3, 5), p)],
        6: [("abort", "b")],
        8: [("add", "d", _prompt(4, 17), SamplingParams(max_tokens=10, temperature=0.0, n=2))],
        11: [("abort", "d"), ("abort", "c")],
    }
    want, eng = _compare(core, script)
    assert {rid for rid, _ in want} == {"a", "b", "c", "d"}
    assert eng.launched_ahead > 0


def test_abort_of_every_request_leaves_nothing_in_flight(core):
    eng_core = _core(core, True)
    eng = LLMEngine(eng_core, SchedulerConfig(max_num_seqs=4))
    eng.add_request("x", _prompt(9, 10), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while eng._inflight is None:
        eng.step()
    assert eng.has_unfinished()
    assert eng.abort("x")
    assert not eng.has_unfinished() and eng._inflight is None  # nothing of the held step is left to read
    assert eng.step() == []
    assert_pool_full(eng_core)


def test_preemption_under_a_small_pool(core):
    """A KV pool of 10 pages for requests that need 4-5 each: the synchronous path preempts, the async one
    drains to it when the pages for a step ahead are missing; the same chunks, no page leaked."""
    script: Script = {0: [("add", f"r{i}", _prompt(20 + i, 20 + 3 * i),
                           SamplingParams(max_tokens=44, temperature=0.0 if i % 2 else 0.8, seed=i,
                                          ignore_eos=True, logprobs=1)) for i in range(4)]}
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128)
    want, sync, _ = _run(core, script, False, sched, num_kv_blocks=10, max_model_len=96)
    got, eng, _ = _run(core, script, True, sched, num_kv_blocks=10, max_model_len=96)
    assert sync.scheduler.num_preemptions > 0 and eng.scheduler.num_preemptions > 0
    assert got == want
    assert eng.launched_ahead > 0


def test_length_limits_are_never_run_ahead(core):
    """Rows at max_tokens or max_model_len are left out of a step ahead: no step ever feeds a row past them."""
    eng_core = _core(core, True, max_model_len=48)
    eng = LLMEngine(eng_core, SchedulerConfig(max_num_seqs=4))
    fed: list[tuple[str, int]] = []
    execute = eng_core.runner.execute

    def spy(batch, input_tokens=None):
        fed.extend((r.request_id, r.num_computed_tokens + n) for r, n in batch)
        return execute(batch, input_tokens)

    eng_core.runner.execute = spy
    eng.add_request("ctx", _prompt(1, 40), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    eng.add_request("max", _prompt(2, 10), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    chunks = []
    while eng.has_unfinished():
        chunks += eng.step()
    ends = {c.request_id: c for c in chunks if c.finish_reason}
    assert ends["ctx"].finish_reason == ends["max"].finish_reason == "length"
    # tokens computed: at most the context less the last token, and the prompt + max_tokens - 1
    assert max(n for rid, n in fed if rid == "ctx") == 47
    assert max(n for rid, n in fed if rid == "max") == 10 + 5 - 1
    assert_pool_full(eng_core)


def test_warm_up_with_async_scheduling(core):
    eng_core = _core(core, True, max_model_len=256)
    eng = LLMEngine(eng_core)
    done = eng.warm_up(capture_graphs=False, lengths=(16, 40), batch=3, batch_len=20, new_tokens=3)
    assert done["prompts"] == 2 + 3
    assert not eng.has_unfinished()
    assert_pool_full(eng_core)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_async_matches_sync_on_random_scripts(core, data):
    """Random arrivals, lengths, sampling modes, stop ids and aborts: the same chunks with and without async
    scheduling."""
    stops = (data.draw(st.integers(0, 48_999)), 13, 28, 30)
    script: Script = {}
    n = data.draw(st.integers(1, 5))
    for i in range(n):
        at = data.draw(st.integers(0, 8))
        greedy = data.draw(st.booleans())
        params = SamplingParams(
            max_tokens=data.draw(st.integers(1, 14)), temperature=0.0 if greedy else 0.8,
            seed=None if greedy else data.draw(st.integers(0, 2**31)), top_k=data.draw(st.sampled_from([None, 20])),
            stop_token_ids=stops if data.draw(st.booleans()) else (), ignore_eos=data.draw(st.booleans()),
            logprobs=data.draw(st.sampled_from([None, 0, 2])), n=data.draw(st.sampled_from([1, 1, 2])))
        script.setdefault(at, []).append(("add", f"q{i}", _prompt(i + 50 * n, data.draw(st.integers(1, 40))),
                                          params))
        if data.draw(st.booleans()):
            script.setdefault(at + data.draw(st.integers(1, 8)), []).append(("abort", f"q{i}"))
    _compare(core, script, SchedulerConfig(max_num_seqs=data.draw(st.sampled_from([2, 8])),
                                           max_num_batched_tokens=data.draw(st.sampled_from([16, 64]))))


@pytest.mark.parametrize("value", [False, True])
def test_config_field_reaches_the_engine(core, value):
    assert LLMEngine(_core(core, value)).async_scheduling is value
