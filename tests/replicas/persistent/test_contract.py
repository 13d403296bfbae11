"""The persistent-decode contract (docs/design.md "Persistent decode contract") and the persistent lane's handling of every outcome.

Backend failures are injected with :class:`FaultyBackend`, a test double of
the *backend boundary* only: it decodes with the real eager backend over the
real KV cache and breaks one rule on purpose. Everything else is real.
"""

from __future__ import annotations

import threading

import pytest
import torch

from replicas.engine import LLMEngine
from replicas.messages import GenerationChunk, GenerationError, Rejection
from replicas.persistent.contract import (
    BackendLaunchError,
    CacheBinding,
    InvalidQuantumResultError,
    PersistentBackend,
    PrelaunchError,
    QuantumRequest,
    QuantumResult,
    UnsupportedConfigurationError,
    validate_request,
    validate_result,
)
from replicas.persistent.eager import EagerBackend
from replicas.persistent.lane import PersistentLane
from replicas.request import Request, SamplingParams
from tests.replicas.conftest import (
    GREEDY,
    PROMPTS,
    assert_pool_full,
    chat_ids,
    greedy_request,
    run_standard,
    small_core,
    tokens_of,
)


class FaultyBackend(EagerBackend):
    """Test double of the persistent-backend boundary (a :class:`PersistentBackend`).

    Decodes with the real eager backend and injects one fault on quantum
    number ``at_quantum`` (1-based):

    * ``"prelaunch"``: raise :class:`PrelaunchError` before running (cache untouched);
    * ``"launch"``: run the quantum for real (the cache changes), then raise
      :class:`BackendLaunchError`;
    * ``"too_many"``, ``"zero"``, ``"committed"``, ``"pending"``: run it for
      real, then return a result breaking that rule of :func:`validate_result`.
    """

    name = "faulty"

    def __init__(self, core, fault: str, at_quantum: int = 1):
        super().__init__(core.model, core.runner.device)
        self.fault, self.at_quantum, self.calls = fault, at_quantum, 0

    def run_quantum(self, req: QuantumRequest) -> QuantumResult:
        self.calls += 1
        if self.calls != self.at_quantum:
            return super().run_quantum(req)
        if self.fault == "prelaunch":
            raise PrelaunchError("injected prelaunch rejection", "unsupported_envelope")
        res = super().run_quantum(req)
        if self.fault == "launch":
            raise BackendLaunchError("injected failure after launch")
        if self.fault == "too_many":
            res.emitted_tokens = res.emitted_tokens + [res.pending_token] * (req.max_tokens + 1 - len(res.emitted_tokens))
            res.committed_kv_length = req.committed_kv_length + len(res.emitted_tokens)
            res.pending_token = res.emitted_tokens[-1]
        elif self.fault == "zero":
            res.emitted_tokens, res.committed_kv_length = [], req.committed_kv_length
        elif self.fault == "committed":
            res.committed_kv_length += 1
        elif self.fault == "pending":
            res.pending_token = res.emitted_tokens[-1] + 1
        else:
            raise AssertionError(f"unknown fault {self.fault}")
        return res


assert issubclass(FaultyBackend, PersistentBackend)


@pytest.fixture(scope="module")
def haiku_ids(tokenizer) -> list[int]:
    return chat_ids(tokenizer, PROMPTS[1])


@pytest.fixture(scope="module")
def greedy17(core, haiku_ids) -> list[int]:
    """Standard-lane greedy continuation: first token + two full quanta."""
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    return tokens_of(run_standard(LLMEngine(core), {"g": (haiku_ids, params)})["g"])


def _qreq(committed=20, max_tokens=4, pages=2, dtype=torch.int32, max_seq=100, **kw) -> QuantumRequest:
    return QuantumRequest(
        pending_token=5, committed_kv_length=committed, max_sequence_length=max_seq, max_tokens=max_tokens,
        full_block_map=torch.arange(pages, dtype=dtype), **{"stop_token_ids": (2,), **kw},
    )


# --- validate_result / validate_request -------------------------------------------------------


def test_validate_result_accepts_results_that_keep_the_rules():
    req = _qreq()
    validate_result(req, QuantumResult("max_tokens", [9, 8, 7, 6], 24, 6, 4))
    validate_result(req, QuantumResult("eos", [2], 21, 2, 1))


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (QuantumResult("max_tokens", [1, 2, 3, 4, 5], 25, 5, 5), "emitted 5 tokens"),  # too many
        (QuantumResult("max_tokens", [], 20, -1, 0), "emitted 0 tokens"),  # none
        (QuantumResult("max_tokens", [1, 2], 23, 2, 2), "committed_kv_length 23"),  # committed != old + n
        (QuantumResult("max_tokens", [1, 2], 20, 2, 2), "committed_kv_length 20"),  # committed not advanced
        (QuantumResult("max_tokens", [1, 2], 22, 1, 2), "pending_token 1"),  # pending != emitted[-1]
    ],
    ids=["too_many", "zero", "committed_too_far", "committed_stale", "pending"],
)
def test_validate_result_rejects_each_broken_rule(result, match):
    with pytest.raises(InvalidQuantumResultError, match=match) as exc:
        validate_result(_qreq(), result)
    assert isinstance(exc.value, BackendLaunchError)  # terminal, never a fallback
    assert exc.value.reason == "invalid_quantum_result"


def test_validate_request_accepts_an_exactly_covering_block_map():
    validate_request(_qreq(committed=28, max_tokens=4, pages=2))  # 32 positions, 2 pages


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"committed": 29, "max_tokens": 4, "pages": 2}, "unsupported_envelope"),  # 33 positions, 2 pages
        ({"pages": 0}, "unsupported_envelope"),
        ({"dtype": torch.int64}, "unsupported_envelope"),
        ({"dtype": torch.float32}, "unsupported_envelope"),
        ({"max_tokens": 0}, "no_output_remaining"),
        ({"committed": 97, "max_tokens": 4, "pages": 8}, "max_sequence_length"),
    ],
    ids=["short_map", "empty_map", "int64_map", "float_map", "zero_tokens", "past_max_len"],
)
def test_validate_request_raises_prelaunch_error(kw, reason):
    with pytest.raises(PrelaunchError) as exc:
        validate_request(_qreq(**kw))
    assert exc.value.reason == reason
    assert not isinstance(exc.value, BackendLaunchError)


def test_validate_request_rejects_a_2d_or_strided_block_map():
    req = _qreq()
    req.full_block_map = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(PrelaunchError):
        validate_request(req)
    req.full_block_map = torch.arange(8, dtype=torch.int32)[::2]
    assert not req.full_block_map.is_contiguous()
    with pytest.raises(PrelaunchError):
        validate_request(req)


# --- CacheBinding ---------------------------------------------------------------------------


def test_cache_binding_views_share_storage_with_the_cache():
    kv = torch.zeros(2, 3, 4, 16, 2, 8, dtype=torch.bfloat16)
    b = CacheBinding.from_kv_tensor(kv)
    assert len(b.key_planes) == len(b.value_planes) == 3
    per_plane = 4 * 16 * 2 * 8 * 2
    for k, v in zip(b.key_planes, b.value_planes, strict=True):
        assert k.dtype == v.dtype == torch.uint8 and k.dim() == v.dim() == 1
        assert k.is_contiguous() and v.is_contiguous() and k.numel() == v.numel() == per_plane
    assert b.key_planes[1].data_ptr() == kv[0, 1].data_ptr()
    assert b.value_planes[2].data_ptr() == kv[1, 2].data_ptr()
    assert b.block_counts == (4, 4, 4) and b.pools == (0, 0, 0)
    assert b.block_strides == (16 * 2 * 8 * 2,) * 3
    assert b.page_shape == (16, 2, 8) and b.dtype == torch.bfloat16
    # writes through the typed planes land in the engine's tensor
    typed = b.typed_planes()
    assert tuple(typed[1][0].shape) == (4, 16, 2, 8) and typed[1][0].dtype == torch.bfloat16
    typed[1][1][2, 5, 1, 3] = 7.0
    typed[0][0][3, 15, 0, 7] = -1.5
    assert kv[1, 1, 2, 5, 1, 3].item() == 7.0
    assert kv[0, 0, 3, 15, 0, 7].item() == -1.5
    assert kv.count_nonzero().item() == 2
    # and raw bytes written through the uint8 view are visible too
    b.key_planes[2][:2] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)  # bf16 1.0, little-endian
    assert kv[0, 2, 0, 0, 0, 0].item() == 1.0


def test_cache_binding_of_the_engine_cache(core):
    b = CacheBinding.from_kv_tensor(core.kv_cache.tensor)
    assert b.block_strides == (core.kv_cache.bytes_per_page,) * core.model.config.num_layers
    assert b.block_counts == (core.allocator.num_blocks,) * core.model.config.num_layers
    assert b.key_planes[0].data_ptr() == core.kv_cache.tensor.data_ptr()


def test_cache_binding_rejects_non_contiguous_or_wrong_pages():
    kv = torch.zeros(2, 2, 4, 16, 2, 8)
    with pytest.raises(UnsupportedConfigurationError):
        CacheBinding.from_kv_tensor(kv[:, :, ::2])
    with pytest.raises(UnsupportedConfigurationError):
        CacheBinding.from_kv_tensor(torch.zeros(2, 2, 4, 8, 2, 8))
    with pytest.raises(UnsupportedConfigurationError):
        CacheBinding.from_kv_tensor(torch.zeros(2, 4, 16, 2, 8))


# --- EagerBackend on the real model -----------------------------------------------------------


def _prefill(core, ids) -> tuple[Request, int]:
    """Prefill ``ids`` through the engine's runner; returns the request (pages held) and its first token."""
    req = Request("prefill", list(ids), GREEDY)
    core.allocator.grow(req.block_table, req.num_tokens)
    first = int(core.runner.execute([(req, req.num_tokens)])[0].argmax())
    req.num_computed_tokens = req.num_tokens
    return req, first


def _quantum(core, req, pending, size, **kw) -> QuantumRequest:
    core.allocator.grow(req.block_table, req.num_computed_tokens + size)
    return QuantumRequest(
        pending_token=pending, committed_kv_length=req.num_computed_tokens,
        max_sequence_length=core.config.max_model_len, max_tokens=size,
        full_block_map=torch.tensor(req.block_table, dtype=torch.int32), **kw,
    )


def test_eager_backend_quanta_equal_the_standard_lane(core, haiku_ids, greedy17):
    backend = EagerBackend(core.model, core.runner.device)
    backend.bind_cache(CacheBinding.from_kv_tensor(core.kv_cache.tensor))
    req, first = _prefill(core, haiku_ids)
    try:
        assert first == greedy17[0]
        pending, got = first, []
        for _ in range(2):
            q = _quantum(core, req, pending, 8)
            res = backend.run_quantum(q)
            validate_result(q, res)
            assert res.finish_reason == "max_tokens" and res.completed_epochs == 8
            assert res.committed_kv_length == req.num_computed_tokens + 8
            req.num_computed_tokens, pending = res.committed_kv_length, res.pending_token
            got += res.emitted_tokens
        assert got == greedy17[1:17]
    finally:
        core.allocator.release(req.block_table)


def test_eager_backend_stops_on_any_stop_id_inside_a_quantum(core, haiku_ids, greedy17):
    k = next(i for i in range(2, 9) if greedy17[i] not in greedy17[1:i])
    backend = EagerBackend(core.model, core.runner.device)
    backend.bind_cache(CacheBinding.from_kv_tensor(core.kv_cache.tensor))
    req, first = _prefill(core, haiku_ids)
    try:
        q = _quantum(core, req, first, 8, stop_token_ids=(99999, greedy17[k]))
        res = backend.run_quantum(q)
        validate_result(q, res)
        assert res.finish_reason == "eos" and res.emitted_tokens == greedy17[1 : k + 1]
        # the same quantum with no stop id runs its full size
        q = _quantum(core, req, first, 8)
        assert backend.run_quantum(q).emitted_tokens == greedy17[1:9]
    finally:
        core.allocator.release(req.block_table)


def test_eager_backend_prelaunch_errors_leave_the_cache_untouched(core, haiku_ids):
    tiny = small_core(core, num_kv_blocks=8, max_model_len=128)
    backend = EagerBackend(tiny.model, tiny.runner.device)
    req, first = _prefill(tiny, haiku_ids)
    try:
        with pytest.raises(PrelaunchError):  # not bound yet
            backend.run_quantum(_quantum(tiny, req, first, 4))
        backend.bind_cache(CacheBinding.from_kv_tensor(tiny.kv_cache.tensor))
        before = tiny.kv_cache.tensor.clone()
        short = _quantum(tiny, req, first, 4)
        short.full_block_map = short.full_block_map[:1]
        with pytest.raises(PrelaunchError):
            backend.run_quantum(short)
        cancelled = _quantum(tiny, req, first, 4, cancellation_flag=threading.Event())
        cancelled.cancellation_flag.set()
        with pytest.raises(PrelaunchError) as exc:
            backend.run_quantum(cancelled)
        assert exc.value.reason == "cancelled"
        assert torch.equal(tiny.kv_cache.tensor, before)
        # a real launch does change it
        backend.run_quantum(_quantum(tiny, req, first, 1))
        assert not torch.equal(tiny.kv_cache.tensor, before)
    finally:
        tiny.allocator.release(req.block_table)
    assert_pool_full(tiny)


# --- the lane's handling of backend failures --------------------------------------------------


def _assert_rejected_without_pages(lane, core, request, reason):
    gen = lane.generate(request)
    item = next(gen)
    assert isinstance(item, Rejection), item
    assert (item.reason, item.lane, item.stage) == (reason, "persistent", "prelaunch")
    assert core.allocator.num_free == core.allocator.num_blocks  # nothing was allocated
    assert list(gen) == []


def test_failure_after_launch_is_terminal_and_marks_the_decoder_unhealthy(core, haiku_ids, greedy17):
    faulty = FaultyBackend(core, "launch", at_quantum=2)
    lane = PersistentLane(core, faulty)
    items = list(lane.generate(greedy_request("boom", haiku_ids)))
    assert [type(i) for i in items] == [GenerationChunk, GenerationChunk, GenerationError]
    assert tokens_of(items[:2]) == greedy17[:9]  # what streamed before the failure was right
    err = items[-1]
    assert (err.stage, err.reason, err.lane) == ("postlaunch", "backend_launch_error", "persistent")
    assert "injected failure after launch" in err.message
    assert not lane.healthy and lane.unhealthy_reason == "backend_launch_error"
    assert lane.stats()["decoder_healthy"] is False
    assert faulty.calls == 2  # never silently retried
    assert_pool_full(core)
    _assert_rejected_without_pages(lane, core, greedy_request("next", haiku_ids), "decoder_unhealthy")
    assert faulty.calls == 2


@pytest.mark.parametrize("fault", ["too_many", "zero", "committed", "pending"])
def test_invalid_quantum_result_is_terminal(core, haiku_ids, greedy17, fault):
    faulty = FaultyBackend(core, fault, at_quantum=1)
    lane = PersistentLane(core, faulty)
    items = list(lane.generate(greedy_request(f"bad-{fault}", haiku_ids)))
    assert [type(i) for i in items] == [GenerationChunk, GenerationError]
    assert items[0].token_ids == greedy17[:1]
    assert (items[1].stage, items[1].reason) == ("postlaunch", "invalid_quantum_result")
    assert not lane.healthy and lane.unhealthy_reason == "invalid_quantum_result"
    assert_pool_full(core)
    _assert_rejected_without_pages(lane, core, greedy_request("next", haiku_ids), "decoder_unhealthy")


@pytest.mark.parametrize("at_quantum", [1, 3])
def test_prelaunch_error_mid_request_falls_back_with_identical_tokens(core, tokenizer, hf_greedy, at_quantum):
    ids = chat_ids(tokenizer, PROMPTS[0])
    faulty = FaultyBackend(core, "prelaunch", at_quantum=at_quantum)
    lane = PersistentLane(core, faulty)
    items = list(lane.generate(greedy_request("fallback", ids)))
    assert all(isinstance(i, GenerationChunk) for i in items), items
    assert tokens_of(items) == hf_greedy(ids, 40, ignore_eos=True)
    assert [len(c.token_ids) for c in items] == [1, 8, 8, 8, 8, 7]
    flagged = [i for i, c in enumerate(items) if c.fallback_reason is not None]
    assert flagged == [at_quantum]  # the chunk of the quantum that fell back, and only that one
    assert items[at_quantum].fallback_reason == "unsupported_envelope"
    assert items[-1].finish_reason == "length"
    assert faulty.calls == at_quantum  # the failing backend is not used again for this request
    assert lane.healthy  # a prelaunch rejection does not mark the decoder unhealthy


# --- admission ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "extra", "reason"),
    [
        (SamplingParams(max_tokens=8, temperature=0.7), {}, "non_greedy"),
        (SamplingParams(max_tokens=8, temperature=1.0, top_k=5), {}, "non_greedy"),
        (SamplingParams(max_tokens=8, temperature=0.0, n=2), {}, "unsupported_decode_batch"),
        (SamplingParams(max_tokens=8, temperature=0.0, logprobs=0), {}, "logprobs"),
        (SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.0), {}, "logits_processing"),
        (SamplingParams(max_tokens=8, temperature=0.0), {"has_stop_token_sequences": True}, "stop_token_sequences"),
        (SamplingParams(max_tokens=8, temperature=0.0), {"kv_transfer": True}, "kv_transfer"),
    ],
    ids=["temperature", "top_k_5", "n2", "logprobs", "penalty", "stop_sequences", "kv_transfer"],
)
def test_lane_rejects_ineligible_requests_with_the_policy_reason(core, haiku_ids, params, extra, reason):
    lane = PersistentLane(core, EagerBackend(core.model, core.runner.device))
    _assert_rejected_without_pages(lane, core, greedy_request("r", haiku_ids, params, **extra), reason)
    assert lane.healthy and lane.quanta_run == 0


def test_lane_rejects_a_prompt_at_the_context_limit(core):
    lane = PersistentLane(core, EagerBackend(core.model, core.runner.device))
    ids = [1] * (core.config.max_model_len - 1)
    _assert_rejected_without_pages(lane, core, greedy_request("long", ids), "max_sequence_length")


def test_lane_rejects_a_second_request_while_busy_then_frees_on_close(core, haiku_ids, greedy17):
    lane = PersistentLane(core, EagerBackend(core.model, core.runner.device))
    first = lane.generate(greedy_request("a", haiku_ids))
    chunk = next(first)
    assert chunk.token_ids == greedy17[:1] and lane.busy
    assert core.allocator.num_free < core.allocator.num_blocks
    free = core.allocator.num_free
    second = list(lane.generate(greedy_request("b", haiku_ids)))
    assert [(type(i), i.reason) for i in second] == [(Rejection, "queued_work")]
    assert core.allocator.num_free == free
    first.close()  # the client went away
    assert not lane.busy
    assert_pool_full(core)


def test_lane_cancellation_ends_with_abort_and_frees_pages(core, haiku_ids):
    lane = PersistentLane(core, EagerBackend(core.model, core.runner.device))
    cancel = threading.Event()
    gen = lane.generate(greedy_request("c", haiku_ids), cancel)
    assert len(next(gen).token_ids) == 1
    assert len(next(gen).token_ids) == 8
    cancel.set()
    rest = list(gen)
    assert len(rest) == 1 and rest[0].finish_reason == "abort" and rest[0].token_ids == []
    assert not lane.busy
    assert_pool_full(core)


def test_top_k_1_is_greedy_and_admitted(core, haiku_ids, greedy17):
    lane = PersistentLane(core, EagerBackend(core.model, core.runner.device))
    params = SamplingParams(max_tokens=17, temperature=0.8, top_k=1, ignore_eos=True)
    items = list(lane.generate(greedy_request("k1", haiku_ids, params)))
    assert tokens_of(items) == greedy17
    assert [len(c.token_ids) for c in items] == [1, 8, 8]


def test_stop_token_ids_end_a_quantum_early_like_the_standard_lane(core, haiku_ids, greedy17):
    k = next(i for i in range(10, 17) if greedy17[i] not in greedy17[:i])
    params = SamplingParams(max_tokens=17, temperature=0.0, stop_token_ids=(greedy17[k],))
    items = list(PersistentLane(core, EagerBackend(core.model, core.runner.device)).generate(
        greedy_request("stop", haiku_ids, params)
    ))
    standard = tokens_of(run_standard(LLMEngine(core), {"s": (haiku_ids, params)})["s"])
    assert tokens_of(items) == standard == greedy17[: k + 1]
    assert [len(c.token_ids) for c in items] == [1, 8, k - 8]
    assert items[-1].finish_reason == "stop"


def test_max_tokens_1_needs_no_quantum(core, haiku_ids, greedy17):
    lane = PersistentLane(core, EagerBackend(core.model, core.runner.device))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    items = list(lane.generate(greedy_request("one", haiku_ids, params)))
    assert [(c.token_ids, c.finish_reason) for c in items] == [(greedy17[:1], "length")]
    assert lane.quanta_run == 0


def test_context_limit_clips_the_last_quantum_like_the_standard_lane(core, haiku_ids, greedy17):
    """max_model_len = prompt + 11: the persistent lane stops where the standard lane does."""
    tiny = small_core(core, num_kv_blocks=8, max_model_len=len(haiku_ids) + 11)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    items = list(PersistentLane(tiny, EagerBackend(tiny.model, tiny.runner.device)).generate(
        greedy_request("edge", haiku_ids, params)
    ))
    standard = run_standard(LLMEngine(tiny), {"s": (haiku_ids, params)})["s"]
    assert tokens_of(items) == tokens_of(standard) == greedy17[:11]
    assert [len(c.token_ids) for c in items] == [1, 8, 2]
    assert items[-1].finish_reason == standard[-1].finish_reason == "length"
    assert_pool_full(tiny)


@pytest.mark.parametrize("ids", [[], [1, 2, 10**6], [-5, 3]], ids=["empty", "past_vocab", "negative"])
def test_a_bad_prompt_fails_the_request_but_not_the_lane(core, haiku_ids, greedy17, ids):
    lane = PersistentLane(core, EagerBackend(core.model, core.runner.device))
    items = list(lane.generate(greedy_request("bad", ids, SamplingParams(max_tokens=4, temperature=0.0))))
    assert len(items) == 1 and isinstance(items[0], GenerationError), items
    assert items[0].stage == "validation" and items[0].reason == "invalid_request"
    assert lane.healthy and not lane.busy
    assert_pool_full(core)
    ok = list(lane.generate(greedy_request("ok", haiku_ids, SamplingParams(max_tokens=2, temperature=0.0))))
    assert tokens_of(ok) == greedy17[:2]
