"""``benchmarks.serve`` and ``ops.tools.eval_gsm8k`` end to end against the session's real server (SmolLM2)."""

from __future__ import annotations

import json

import pytest

from benchmarks import serve as bench_serve
from ops.tools import eval_gsm8k, gsm8k

pytestmark = pytest.mark.ray


def test_bench_serve_random_prompts_with_lane_breakdown(server, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    summary = bench_serve.main([
        "--base-url", server, "--num-prompts", "4", "--max-concurrency", "2", "--dataset", "random",
        "--random-input-len", "16", "--random-output-len", "8", "--json", str(out), "--plot", str(png),
        "--no-progress"])
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["output_tokens"] == 4 * 8  # ignore_eos: exactly the asked length
    assert set(summary["per_lane"]) <= {"persistent", "standard"} and "persistent" in summary["per_lane"]
    assert sum(b["completed"] for b in summary["per_lane"].values()) == 4
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        st = summary[metric]
        assert 0 < st["mean"] and 0 < st["median"] <= st["p99"]
    assert summary["ttft_ms"]["p99"] <= summary["e2el_ms"]["p99"]
    saved = json.loads(out.read_text())
    assert len(saved["requests"]) == 4 and all(r["lane"] for r in saved["requests"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(bench_serve.save_result("ci", saved, tmp_path / "results").read_text())
    assert result["study"] == "serving" and result["rows"][0]["scope"] == "all"
    assert result["rows"][0]["completed"] == 4 and {"label", "ttft_ms_median", "output_tok_s"} <= set(result["rows"][0])


def test_bench_serve_gsm8k_prompts_at_a_request_rate_forced_standard(server):
    summary = bench_serve.main([
        "--base-url", server, "--num-prompts", "3", "--request-rate", "5", "--dataset", "gsm8k",
        "--gsm8k-file", str(gsm8k.SAMPLE_DIR / "test_head4.jsonl"), "--random-output-len", "6",
        "--lane", "standard", "--no-progress"])
    assert summary["completed"] == 3 and list(summary["per_lane"]) == ["standard"]


def test_eval_gsm8k_lanes_agree_on_every_completion(server, tmp_path):
    out = tmp_path / "eval.json"
    report = eval_gsm8k.main([
        "--base-url", server, "--test-file", str(gsm8k.SAMPLE_DIR / "test_head4.jsonl"),
        "--fewshot-file", str(gsm8k.SAMPLE_DIR / "train_head3.jsonl"), "--limit", "3",
        "--max-tokens", "40", "--json", str(out), "--no-progress"])
    assert report["num_problems"] == 3 and report["num_fewshot"] == 3
    for lane in ("persistent", "standard"):
        assert report["lanes"][lane]["lane_mismatches"] == 0  # each lane really served its requests
    eq = report["equivalence"]
    assert eq["fraction_identical"] == 1.0 and eq["identical"] == 3 and not eq["examples"], eq
    rows = json.loads(out.read_text())["problems"]
    assert all(r["lanes"]["persistent"]["output_tokens"] > 0 for r in rows)
    assert report["lanes"]["persistent"]["strict_match"] == report["lanes"]["standard"]["strict_match"]


def test_eval_gsm8k_names_the_option_when_data_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data-dir or --test-file"):
        eval_gsm8k.main(["--data-dir", str(tmp_path), "--limit", "1"])


def test_ttft_breakdown_reads_each_hop_from_the_requests_own_traces(server, otlp):
    """``benchmarks.hops.breakdown`` against the real app: every segment was read from the request's spans,
    each is positive, and together they are the client's TTFT (one machine's clock)."""
    from benchmarks.hops import SEGMENTS, breakdown

    model = "smollm2-135m-instruct"
    out = breakdown(server, otlp, model, 3, 4)
    assert set(out) == {"persistent", "standard"}
    for lane, row in out.items():
        assert row["requests"] == 3 and row["served"] == [lane], row
        assert all(row[k] > 0 for k in SEGMENTS), row
        # medians of the parts need not add up to the median of the whole, but they are of the same requests
        assert 0.5 * row["ttft"] <= sum(row[k] for k in SEGMENTS) <= 1.5 * row["ttft"], row
    assert out["persistent"]["per_chunk_back"] > 0  # 4 tokens: one chunk from the prefill, one quantum
    ids = breakdown(server, otlp, model, 2, 4, lanes=("standard",), prompt_token_ids=[1, 2, 3, 4, 5])
    assert ids["standard"]["requests"] == 2 and ids["standard"]["engine"] > 0
    # the ingress segment, split at the handler's marks on the HTTP span
    parts = ("ingress_body", "ingress_plan", "ingress_route")
    assert all(ids["standard"][k] >= 0 for k in parts), ids
    assert abs(sum(ids["standard"][k] for k in parts) - ids["standard"]["ingress"]) <= 0.5 * ids["standard"]["ingress"]


def test_burst_gives_each_concurrent_request_its_own_segments(server, otlp):
    """``benchmarks.hops.burst``: 3 requests at once, each read from its own trace, in send order."""
    from benchmarks.hops import SEGMENTS, burst

    rows = burst(server, otlp, "smollm2-135m-instruct", 3, 4, prompts=[[1, 2, 3, 4, 5], [6, 7, 8], [9, 10]])
    assert len(rows) == 3 and [r["lane"] for r in rows] == ["standard"] * 3
    assert rows[0]["sent_after_first"] == 0 and all(r["sent_after_first"] >= 0 for r in rows)
    for row in rows:
        assert all(row[k] > 0 for k in SEGMENTS), row
        assert 0 < row["ttft"] <= row["e2el"], row
    from benchmarks.hops import burst_summary  # the first_burst result row of those three

    summary = burst_summary(rows, 1, "standard", 3, 4)
    assert summary["served"] == "standard" and summary["burst"] == 1
    assert summary["ttft_ms_median"] == round(sorted(r["ttft"] for r in rows)[1], 1)
    assert summary["engine_ms_median"] == round(sorted(r["engine"] for r in rows)[1], 1)


def test_cpu_per_token_names_each_serving_process_and_counts_every_token(server):
    """``benchmarks.hops.cpu_per_token`` on the real app: the relay processes and the engine each spent CPU on
    the streamed tokens, and every token arrived as a chunk (the standard lane streams one token per chunk)."""
    from benchmarks.hops import cpu_per_token

    row = cpu_per_token(server, "smollm2-135m-instruct", 2, 2, 6)
    assert row["concurrency"] == 2 and row["output_tok_s"] > 0 and row["chunks_per_token"] == 1.0, row
    for role in ("ProxyActor", "OpenAIIngress", "StandardReplica", "EngineActor"):
        assert row[role] > 0, row


def test_profile_engine_samples_the_busy_engine_actor_s_stacks(server, tmp_path):
    """``benchmarks.hops.profile_engine`` while streams run: py-spy's stacks of the engine actor that serves them
    show its engine loop stepping the standard lane."""
    import concurrent.futures

    from benchmarks.hops import cpu_per_token, profile_engine

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        found = pool.submit(profile_engine, 2, tmp_path / "stacks.txt")
        # two passes (warm-up, measured) of 2 waves x 32 tokens: longer than the 1 s pick + 2 s record
        cpu_per_token(server, "smollm2-135m-instruct", 4, 8, 32)
        found = found.result()
    assert "error" not in found, found
    assert found["samples"] > 0 and (tmp_path / "stacks.txt").stat().st_size > 0
    assert any("_engine_loop" in frame for _, frame in found["top"]), found["top"][:10]
