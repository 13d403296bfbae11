"""Where the standard engine's time per output token goes, outside the model: the host work of a step.

One in-process :class:`~replicas.engine.LLMEngine` (no Ray, no Serve) decodes ``C`` concurrent requests of
``--max-tokens`` tokens each (chat-templated prompts, ``ignore_eos``). Each step's wall time is split into
three parts by timing the engine's own calls:

* ``forward``: :meth:`ModelRunner.execute` (on a GPU it returns once the work is queued; the wait for the GPU
  then lands in ``sample``);
* ``sample``: :func:`replicas.sampler.sample_rows`, with the read of the sampled tokens (on a GPU, the sync);
  on a CPU it is mostly the random draws of sampled rows (a multinomial over the vocabulary per row); with
  ``async_scheduling`` also :func:`replicas.sampler.queue_picks` and :meth:`~replicas.sampler.QueuedPicks.read`
  (the wait for a step's picks, a step after its launch);
* ``host``: the rest of the step: scheduling, page accounting, step inputs, stop checks, the chunks.

``host`` is the engine's Python per token that no kernel speeds up (the number issue 33's "per-token Python
in the engine loop" is about). Run it at the base commit and at ``HEAD`` to compare.

Each row also gives ``cpu_ms_per_token``: the process's CPU time (every thread, ``time.process_time``) per
output token. Against the wall time it says whether the engine thread works or waits: a thread that spins in
CUDA's default synchronisation while the GPU runs is busy all the time, one that sleeps on a blocking event
(``EngineConfig.blocking_sync``) is not. On a GPU, ``--shape`` builds a model of that shape with random weights
(``benchmarks.engine.build_core``) and ``--engine`` runs each given engine config in turn.

Usage: ``python -m benchmarks.host --concurrency 8 32 --sampling greedy sampled --results benchmarks/results``;
on a GPU: ``python -m benchmarks.host --shape gpt-oss-120b --sampling greedy --engine '' 'blocking_sync=true'``
"""

from __future__ import annotations

import argparse
import time


def measure(core, concurrency: int, max_tokens: int, temperature: float, prompts: list[list[int]]) -> dict:
    """One run: ``concurrency`` requests of ``max_tokens`` tokens added at once, stepped until done.

    Returns:
        ``{"tokens", "steps", "wall_ms_per_token", "forward_ms_per_token", "sample_ms_per_token",
        "host_ms_per_token", "cpu_ms_per_token"}``.
    """
    import replicas.engine as engine_module
    from replicas.engine import LLMEngine
    from replicas.request import SamplingParams

    engine = LLMEngine(core)
    spent = {"forward": 0.0, "sample": 0.0}
    execute, sample_rows = core.runner.execute, engine_module.sample_rows
    queue_picks, read = engine_module.queue_picks, engine_module.QueuedPicks.read

    def timed(part, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
        return run

    core.runner.execute = timed("forward", execute)
    engine_module.sample_rows = timed("sample", sample_rows)
    engine_module.queue_picks = timed("sample", queue_picks)
    engine_module.QueuedPicks.read = timed("sample", read)
    try:
        for i in range(concurrency):
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
            engine.add_request(f"r{i}", prompts[i % len(prompts)], params)
        tokens = steps = 0
        start, cpu = time.perf_counter(), time.process_time()
        while engine.has_unfinished():
            tokens += len(engine.step())
            steps += 1
        total, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        core.runner.execute = execute
        engine_module.sample_rows = sample_rows
        engine_module.queue_picks, engine_module.QueuedPicks.read = queue_picks, read
    host = total - spent["forward"] - spent["sample"]
    return {"tokens": tokens, "steps": steps, "wall_ms_per_token": round(total * 1e3 / tokens, 4),
            "cpu_ms_per_token": round(cpu * 1e3 / tokens, 4),
            "forward_ms_per_token": round(spent["forward"] * 1e3 / tokens, 4),
            "sample_ms_per_token": round(spent["sample"] * 1e3 / tokens, 4),
            "host_ms_per_token": round(host * 1e3 / tokens, 4)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="engine model (default: the embedded one)")
    p.add_argument("--shape", default=None,
                   help="a model shape of ops.tools.model_shapes with random weights instead of --model (GPU)")
    p.add_argument("--prompt-len", type=int, default=1024, help="random prompt tokens with --shape")
    p.add_argument("--engine", nargs="+", default=[""],
                   help="engine configs to run in turn, each space-separated field=value ('' for the default)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16", help="with --shape")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--sampling", nargs="+", choices=("greedy", "sampled"), default=["greedy", "sampled"],
                   help="greedy (temperature 0) and/or sampled (temperature 0.7, unseeded)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs per row (the median host time is kept)")
    p.add_argument("--label", default=None, help="what this run measures (e.g. the commit's change), in each row")
    p.add_argument("--results", default=None, help="folder for the result JSON (e.g. benchmarks/results)")
    args = p.parse_args(argv)

    from benchmarks.engine import parse_variant

    rows = []
    for spec in args.engine:
        core = _core(args, spec)
        prompts = _prompts(core, args)
        measure(core, 4, 4, 0.0, prompts)  # warm-up
        for sampling in args.sampling:
            for c in args.concurrency:
                runs = [measure(core, c, args.max_tokens, 0.0 if sampling == "greedy" else 0.7, prompts)
                        for _ in range(args.repeats)]
                run = sorted(runs, key=lambda r: r["host_ms_per_token"])[len(runs) // 2]
                row = {"shape": args.shape or core.config.name, "lane": "standard", "variant": spec or None,
                       "engine": {k: getattr(core.config, k) for k in parse_variant(spec)},  # as the engine loaded it
                       "concurrency": c, "sampling": sampling, **run, "label": args.label,
                       "host_ms_per_token_runs": [r["host_ms_per_token"] for r in runs]}
                rows.append(row)
                print(row, flush=True)
        del core, prompts
        _free()
        if args.results:  # rewritten after every engine config: a run cut short keeps what it measured
            from benchmarks.results import write_result

            notes = ("Wall time per output token of one in-process standard engine, split by timing "
                     "ModelRunner.execute (forward) and sample_rows (sample, with the token read); host is the rest "
                     "of the step.")
            path = write_result('engine_host', rows, args.results, notes=notes, tag=args.label)
    if args.results:
        print(f"wrote {path}")
    return rows


def _core(args, spec: str):
    """The engine core of one ``--engine`` config: the embedded model (or ``--model``), or ``--shape`` with random
    weights and a KV cache for ``max(--concurrency)`` requests."""
    from benchmarks.engine import build_core, parse_variant
    from replicas.config import EngineConfig
    from replicas.engine import EngineCore

    overrides = parse_variant(spec)
    if args.shape:
        import torch

        device = EngineConfig(device=args.device).resolved_device()
        max_len = args.prompt_len + args.max_tokens + 16
        overrides = {"max_num_seqs": max(args.concurrency),
                     "num_kv_blocks": max(args.concurrency) * -(-max_len // 16) + 8, **overrides}
        return build_core(args.shape, device, getattr(torch, args.dtype), max_len, overrides)

    fields = {"device": args.device, "progress": False, "max_num_seqs": max(args.concurrency), **overrides}
    if args.model:
        fields["model"] = args.model
    return EngineCore.load(EngineConfig(**fields))


def _prompts(core, args) -> list[list[int]]:
    """Six chat-templated questions, or with ``--shape`` (no tokenizer) one random prompt of ``--prompt-len``
    per request of the largest concurrency. Distinct prompts matter there: greedy rows with the same prompt
    emit the same tokens, so a MoE model's rows would route to the same experts and the step would read
    fewer expert weights than distinct requests make it read (and the prefix cache would share the prompts)."""
    if args.shape:
        import random

        rng = random.Random(1)
        vocab = core.model.config.vocab_size
        return [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(max(args.concurrency))]
    questions = ("What is the capital of France?", "Tell me about the sea.", "Name three colors.",
                 "How do birds fly?", "Explain what a CPU does.", "Write a haiku about rain.")
    return [list(core.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=True)["input_ids"]) for q in questions]


def _free() -> None:
    import gc

    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
