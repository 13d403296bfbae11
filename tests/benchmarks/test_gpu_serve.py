"""The GPU serve recipe's result rows, from a summary shaped as the recipe records it (no GPU, no Ray)."""

from benchmarks.recipes.gpu_serve import hops_rows, served_rows
from benchmarks.results import load, write_result


def _summary():
    run = {"summary": {"ttft_ms": {"median": 94.0}, "tpot_ms": {"median": 2.5}, "e2el_ms": {"median": 700.0},
                       "output_throughput": 300.0}}
    return {"models": {"gpt-oss-120b": {
        "serve": {"persistent c=1": run},
        "engine": {"persistent c=1": {"summary": {**run["summary"], "ttft_ms": {"median": 78.0}}}},
        "breakdown": {
            "persistent": {"requests": 20, "to_ingress": 4.2, "ingress": 2.8, "to_replica": 3.0, "to_engine": 1.8,
                           "engine": 22.6, "back": 2.5, "ttft": 37.4, "ingress_body": 2.6},
            "cpu_per_token c=32": {"concurrency": 32, "output_tok_s": 1074.5, "ProxyActor": 0.63,
                                   "OpenAIIngress": 0.59, "ColocatedReplica": 0.1, "EngineActor": 0.95},
            "engine_profile c=32": {"error": "py-spy not installed"},
        }}}}


def test_hops_rows_give_each_segment_the_ttft_and_each_process_cpu(tmp_path):
    rows = hops_rows(_summary())
    segments = [(r["segment"], r["ms"]) for r in rows if "segment" in r]
    assert segments == [("to_ingress", 4.2), ("ingress", 2.8), ("to_replica", 3.0), ("to_engine", 1.8),
                        ("engine", 22.6), ("back", 2.5), ("TTFT", 37.4)]
    cpu = {r["process"]: r["cpu_ms_per_token"] for r in rows if "process" in r}
    assert cpu == {"proxy": 0.63, "ingress": 0.59, "co-located replica": 0.1, "engine actor": 0.95}
    assert {r["concurrency"] for r in rows if "process" in r} == {32}
    write_result("serve_hops", rows, tmp_path)
    (doc,) = load(tmp_path)
    assert doc["study"] == "serve_hops" and doc["rows"] == rows


def test_served_rows_pair_serve_with_the_engine_alone():
    (row,) = served_rows(_summary())
    assert (row["lane"], row["concurrency"], row["ttft_ms_serve"], row["ttft_ms_engine"]) == ("persistent", 1, 94.0, 78.0)
