"""The studies: each benchmark as data (the question it answers, the command that answers it, the row fields its
result JSON carries). :mod:`benchmarks.__main__` runs them and :mod:`benchmarks.docs` renders the newest result
of each into ``docs/benchmarks.md``.

A study's command is a module of this package with its arguments; sweep values (concurrencies, prompt lengths,
tiles, engine config fields) are arguments of that module, never module globals. Every run writes one JSON per
study into its ``--out`` folder (:func:`benchmarks.results.write_result`); the ones the docs show are kept in
``benchmarks/results/``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Study:
    """One question and how it is measured.

    Attributes:
        name: the ``study`` field of its result files.
        question: what it answers, one sentence.
        command: the module and default arguments (``python -m`` form) that measure it.
        fields: the row fields, in the order the docs table shows them (rows may carry more).
        machine: where it runs (``H200``, ``CPU``): the docs say where a number comes from.
        pivots: ``(key, value, header)`` triples the docs table turns into columns: rows that differ only in
            ``key`` and ``value`` become one row with a column per ``key`` holding its ``value``, headed
            ``header.format(key's value)`` (a TTFT segment per column instead of a row per segment).
    """

    name: str
    question: str
    command: str
    fields: tuple[str, ...]
    machine: str = "H200"
    pivots: tuple[tuple[str, str, str], ...] = ()


STUDIES: dict[str, Study] = {s.name: s for s in (
    Study("served_product",
          "What does a user of the served app wait for, through Serve, against the engine alone in the same call?",
          "bash benchmarks/recipes/gpu_serve.sh run DIR --models gpt-oss-120b",
          ("shape", "lane", "concurrency", "ttft_ms_serve", "ttft_ms_engine", "tpot_ms_serve", "tpot_ms_engine",
           "e2el_ms_serve", "e2el_ms_engine", "output_tok_s_serve", "output_tok_s_engine")),
    Study("serve_hops",
          "Where does the time to first token go between the client and the engine, and what CPU does each "
          "process spend per streamed token?",
          "bash benchmarks/recipes/gpu_serve.sh run DIR --models smollm2",
          ("shape", "lane", "variant", "concurrency", "output_tok_s"),
          pivots=(("segment", "ms", "{} ms"), ("process", "cpu_ms_per_token", "{} CPU ms/token"))),
    Study("batch_one",
          "How fast does one request decode and prefill on one GPU, engine alone, per lane?",
          "python -m benchmarks.engine --shapes gpt-oss-120b,gpt-oss-20b,smollm2-135m",
          ("shape", "lane", "variant", "prompt_tokens", "ttft_ms", "tpot_ms", "tpot_floor_ms")),
    Study("standard_sweep",
          "How does the standard lane's decode step scale with concurrency against its bytes floor?",
          "python -m benchmarks.prefill --parts gpt-oss-120b",
          ("shape", "batch_invariant", "concurrency", "decode_step_ms", "step_floor_ms", "output_tok_s",
           "itl_median_ms")),
    Study("lane_agreement",
          "Do greedy tokens depend on the prompt alone: persistent == standard, concurrent == alone?",
          "python -m benchmarks.prefill --parts lanes",
          ("check", "dtype", "shape", "identical", "total")),
    Study("moe_kernels",
          "How fast is one MoE layer per backend and token count at gpt-oss-120b's shape?",
          "python -m benchmarks.prefill --parts kernels",
          ("backend", "tokens", "ms", "of_bytes_floor")),
    Study("decode_moe",
          "How fast is one decode MoE layer per kernel and token count against the bytes it must read?",
          "python -m benchmarks.decode_moe --tokens 1 8 16 32 64 128 256",
          ("shape", "kernel", "tiles"), pivots=(("tokens", "us", "{} tokens µs"),)),
    Study("gsm8k_equivalence",
          "On real weights, do the two lanes give the same GSM8K answers?",
          "python -m ops.tools.eval_gsm8k (through benchmarks/recipes/gpu_serve.py)",
          ("model", "prompts", "tokens", "identical", "accuracy_persistent", "accuracy_standard")),
    Study("serving",
          "Through the served app, what do TTFT, TPOT and throughput look like per lane for a scenario?",
          "python -m benchmarks.serve --results benchmarks/results --label LABEL",
          ("label", "scope", "completed", "output_tok_s", "ttft_ms_median", "ttft_ms_p99", "tpot_ms_median",
           "e2el_ms_median"), machine="CPU"),
    Study("engine_host",
          "How much of the standard engine's time per output token is host work outside the model and the sampler?",
          "python -m benchmarks.host --concurrency 8 32 --sampling greedy sampled",
          ("shape", "variant", "concurrency", "sampling", "label", "wall_ms_per_token", "cpu_ms_per_token",
           "host_ms_per_token", "sample_ms_per_token", "forward_ms_per_token"), machine="CPU"),
    Study("first_burst",
          "Are the first concurrent greedy streams after start slower on the router's own choice than forced "
          "standard, and is that the first burst or the lane?",
          "python -m benchmarks.hops --iters 0 --burst 8 --burst-lanes persistent,standard,persistent,standard",
          ("label", "burst", "x_lane", "served", "concurrency", "ttft_ms_median", "e2el_ms_median",
           "engine_ms_median"), machine="CPU"),
    Study("cpu_standard_lane",
          "On a laptop CPU, how does the standard lane compare with transformers' generate?",
          "python -m benchmarks.standard",
          ("shape", "concurrency", "ours_tok_s", "transformers_tok_s", "ttft_ms"), machine="CPU"),
)}
"""Every study, by name."""
