"""Two persistent replicas on two GPUs of one machine, and a standard replica on a fraction of one.

The claim "one TP1 persistent replica per GPU" on real hardware (no two-GPU run yet; its CPU dry run found
``docs/decisions/0008-recheck-pool-before-spilling.md``). On a machine with two GPUs (``benchmarks/recipes/gpu_serve.sh run`` installs the carried
wheels first; ``GPU_SERVE_RECIPE=benchmarks.recipes.gpu_two_replicas`` makes it run this), one local Ray cluster with
``num_gpus=2``, one Serve instance, and the app deployed through Serve's config path (what ``serve deploy``
does): the embedded SmolLM2-135M-Instruct (real weights), ``cuda_graph`` backend,
``num_persistent_replicas=2`` at ``--persistent-gpus`` (0.75) each, so no two fit on one GPU, and one
standard replica at ``--standard-gpus`` (0.25), which fits beside either. Sections, each guarded (one that
fails is recorded in ``errors`` and the others still run) and started only while ``--budget-s`` lasts:

* ``devices``: each engine actor's ``CUDA_VISIBLE_DEVICES``, Ray's GPU ids, ``torch.cuda.current_device()``,
  device name and UUID (``/debug/stats``: the engines' ``accelerator`` field); the two persistent engines'
  must differ;
* ``tpot``: ``benchmarks.serve`` greedy through HTTP on the persistent lane, one stream alone, then two
  streams at once (one per replica: both engines' quanta counts grow), TPOT/ITL/TTFT medians and the ratio,
  and how many greedy requests the router spilled to the standard lane (its ``spillovers`` counter);
* ``sampled``: the two greedy streams again while sampled requests (``--sampled-temperature``) run on the
  standard lane: their lanes, failures and the greedy streams' TPOT meanwhile;
* ``third``: the persistent pool scaled to 3 replicas (the same config with a ``num_replicas`` override of
  ``PersistentReplica``, a lightweight update: nothing restarts) and watched for ``--pending-s``: the third
  replica must not start (no GPU has ``--persistent-gpus`` left; its placement group stays pending), the two
  running engines keep their processes and a greedy request still goes persistent; then back to 2.

``summary.json`` and ``report.md`` in ``--out`` are rewritten after every section; ``summary.json``'s
``checks`` holds the pass/fail of each claim.

CPU dry run of the same code path (``--cpu-smoke``): Ray is given two *simulated* GPUs (``ray.init(num_gpus=2)``
on a machine without one; Ray still sets each actor's ``CUDA_VISIBLE_DEVICES`` from the GPU ids it assigns),
the engines run on ``device=cpu`` with the ``eager`` backend and small prompts, and every check above but the
CUDA device names and the TPOT comparison holds the same way.

Usage (device): ``python3 -m benchmarks.recipes.gpu_two_replicas --out $OUT``; CPU: ``python -m
benchmarks.recipes.gpu_two_replicas --out /tmp/two --cpu-smoke``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from benchmarks.recipes.gpu_serve import Recipe, log

APP = "two"
MODEL = "smollm2-135m-instruct"
SECTION_COST_S = {"deploy": 90, "devices": 5, "tpot": 60, "sampled": 40, "third": 45}
"""Rough device seconds of each section on an H200 (``deploy``: three engines loading SmolLM2 at once)."""
PERSISTENT = "PersistentReplica"
INTERFERENCE_LIMIT = 1.10
"""Two streams at once count as "no interference beyond noise" when their TPOT median is at most this
many times the single stream's (the run-to-run spread of the single-GPU runs was a few percent)."""


class TwoReplicaRecipe(Recipe):
    """The run: two (real or simulated) GPUs, the app deployed through Serve's config path."""

    num_gpus = 2
    costs = SECTION_COST_S

    def __init__(self, args):
        super().__init__(args)
        self.results["checks"] = {}
        self.base = f"http://127.0.0.1:{self.port}/{APP}"

    def render(self, results: dict) -> str:
        return report(results)

    def check(self, name: str, ok: bool, detail=None) -> bool:
        self.results["checks"][name] = {"ok": bool(ok), "detail": detail}
        log(f"  check {name}: {'ok' if ok else 'FAILED'} {detail if detail is not None else ''}")
        return bool(ok)

    # ---- the app, through Serve's config path ------------------------------------------------------
    def app_args(self) -> dict:
        a = self.args
        args = {"model": MODEL, "max_model_len": a.prompt_len + a.new_tokens + 64, "num_kv_blocks": a.num_kv_blocks,
                "progress": False, "tracing_exporter": "none", "engine_num_cpus": 0.5 if a.cpu_smoke else 1.0,
                "num_persistent_replicas": 2, "num_standard_replicas": 1,
                "persistent_pool": {"num_gpus": a.persistent_gpus, "health_check_period_s": 5.0},
                "standard_pool": {"num_gpus": a.standard_gpus}}
        if a.cpu_smoke:
            args.update(device="cpu", persistent_backend="eager")
        else:
            args.update(persistent_backend="cuda_graph")
        return args

    def apply(self, persistent_replicas: int | None = None) -> None:
        """Deploy (or update) the app from a Serve config: ``deployments.app:build_app`` with
        :meth:`app_args`; ``persistent_replicas`` overrides ``PersistentReplica``'s ``num_replicas``
        (the args are unchanged, so Serve keeps the code version and only scales)."""
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema

        overrides = [] if persistent_replicas is None else [{"name": PERSISTENT, "num_replicas": persistent_replicas}]
        schema = ServeDeploySchema.model_validate({
            "http_options": {"host": "127.0.0.1", "port": self.port},
            "applications": [{"name": APP, "route_prefix": f"/{APP}", "import_path": "deployments.app:build_app",
                              "args": self.app_args(), "deployments": overrides}]})
        _get_global_client().deploy_apps(schema)

    def deploy(self) -> dict:
        t0 = time.monotonic()
        self.apply()
        wait_running(time.monotonic() + 600)
        while True:
            try:
                if httpx.get(f"{self.base}/health", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 600:
                raise TimeoutError("/health not 200 after 600 s")
            time.sleep(0.25)
        out = {"startup_s": round(time.monotonic() - t0, 1), "app": self.app_args()}
        log(f"app up in {out['startup_s']} s at {self.base}")
        return out

    def engines(self, lane: str) -> list[dict]:
        return httpx.get(f"{self.base}/debug/stats", timeout=30).json()[lane]["engines"]

    def spillovers(self) -> int:
        """The router's count of eligible requests it sent standard for capacity (``/debug/stats``)."""
        return int(httpx.get(f"{self.base}/debug/stats", timeout=30).json()["router"]["spillovers"])


def wait_running(deadline: float) -> None:
    """Until the app is RUNNING (raises on DEPLOY_FAILED or at ``deadline``, a ``time.monotonic()``)."""
    from ray import serve

    while time.monotonic() < deadline:
        app = serve.status().applications.get(APP)
        if app is not None and app.status == "RUNNING":
            return
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(f"app {APP} failed to deploy: {app.message}")
        time.sleep(0.5)
    raise TimeoutError(f"app {APP} not RUNNING: {serve.status().applications.get(APP)}")


# ---- sections ---------------------------------------------------------------------------------------
def devices(recipe: TwoReplicaRecipe) -> dict:
    """Where each engine runs: its ``accelerator`` facts; the two persistent engines' must differ."""
    persistent, standard = recipe.engines("persistent"), recipe.engines("standard")
    rows = [{"lane": lane, "pid": e["pid"], **e["accelerator"]} for lane, es in
            (("persistent", persistent), ("standard", standard)) for e in es]
    for r in rows:
        log(f"  {r['lane']} engine pid {r['pid']}: CUDA_VISIBLE_DEVICES={r['cuda_visible_devices']} Ray GPU ids "
            f"{r['gpu_ids']} cuda device {r['cuda_device']} {r['cuda_device_name']} {r['cuda_device_uuid']}")
    visible = [e["accelerator"]["cuda_visible_devices"] for e in persistent]
    recipe.check("two_persistent_engines", len(persistent) == 2, len(persistent))
    recipe.check("persistent_cuda_visible_devices_distinct", len(persistent) == 2 and None not in visible
                 and len(set(visible)) == 2, visible)
    if not recipe.args.cpu_smoke:
        uuids = [e["accelerator"]["cuda_device_uuid"] for e in persistent]
        recipe.check("persistent_gpu_uuids_distinct", None not in uuids and len(set(uuids)) == 2, uuids)
    shared = [e["accelerator"]["cuda_visible_devices"] for e in standard]
    recipe.check("standard_shares_a_persistent_gpu", len(standard) == 1 and shared[0] in visible, shared)
    return {"engines": rows}


def _quanta(recipe: TwoReplicaRecipe) -> dict[int, int]:
    return {e["pid"]: int(e.get("quanta_run", 0)) for e in recipe.engines("persistent")}


def _bench(recipe: TwoReplicaRecipe, prompts: list, concurrency: int, temperature: float = 0.0,
           lane: str | None = "persistent", tokens: int | None = None):
    from benchmarks.serve import run

    return run(recipe.base, MODEL, prompts, tokens or recipe.args.new_tokens, float("inf"), concurrency,
               temperature, True, lane, 0, progress=False)


def _summary(records, duration) -> dict:
    from benchmarks.serve import summarize

    s = summarize(records, duration)
    return {"completed": s["completed"], "failed": s["failed"], "errors": s["errors"][:3],
            "lanes": sorted({r.lane or "?" for r in records}),
            "served_standard": sum(r.lane == "standard" for r in records),
            **{f"{m}_p50_ms": s[f"{m}_ms"]["median"] for m in ("ttft", "tpot", "itl", "e2el")}}


def _prompts(recipe: TwoReplicaRecipe, n: int, seed: int) -> list:
    from benchmarks.serve import random_prompts

    return random_prompts(n, recipe.args.prompt_len, 100, 20000, seed=seed)


def tpot(recipe: TwoReplicaRecipe) -> dict:
    """One greedy stream alone vs two at once (one per persistent replica), through HTTP."""
    a = recipe.args
    asyncio.run(_bench(recipe, _prompts(recipe, 2, 0), 2))  # warm-up: each replica's first request
    alone = _summary(*asyncio.run(_bench(recipe, _prompts(recipe, a.rounds, 1), 1)))
    before, spills = _quanta(recipe), recipe.spillovers()
    both = _summary(*asyncio.run(_bench(recipe, _prompts(recipe, 2 * a.rounds, 2), 2)))
    after = _quanta(recipe)
    both["router_spillovers"] = recipe.spillovers() - spills
    grew = {pid: after.get(pid, 0) - n for pid, n in before.items()}
    ratio = (both["tpot_p50_ms"] / alone["tpot_p50_ms"]) if alone["tpot_p50_ms"] and both["tpot_p50_ms"] else None
    log(f"  one stream alone: {alone}")
    log(f"  two streams at once: {both}; quanta per engine pid {grew}; TPOT ratio {ratio}")
    recipe.check("both_streams_persistent", both["lanes"] == ["persistent"] and both["failed"] == 0
                 and alone["lanes"] == ["persistent"], {"alone": alone["lanes"], "both": both["lanes"]})
    recipe.check("both_persistent_engines_served", len(grew) == 2 and all(n > 0 for n in grew.values()), grew)
    if not a.cpu_smoke:
        recipe.check("no_interference_beyond_noise", ratio is not None and ratio <= INTERFERENCE_LIMIT,
                     None if ratio is None else round(ratio, 3))
    return {"alone": alone, "both": both, "tpot_ratio": None if ratio is None else round(ratio, 3),
            "quanta_per_engine": grew}


def sampled(recipe: TwoReplicaRecipe) -> dict:
    """The two greedy streams again while sampled requests run on the standard lane."""
    a = recipe.args

    async def together():
        return await asyncio.gather(
            _bench(recipe, _prompts(recipe, 2 * a.rounds, 3), 2),
            _bench(recipe, _prompts(recipe, a.sampled_requests, 4), a.sampled_concurrency, a.sampled_temperature,
                   lane=None, tokens=a.sampled_tokens))

    spills = recipe.spillovers()
    greedy, sample = asyncio.run(together())
    greedy, sample = _summary(*greedy), _summary(*sample)
    greedy["router_spillovers"] = recipe.spillovers() - spills
    log(f"  greedy meanwhile: {greedy}")
    log(f"  sampled (temperature {a.sampled_temperature}): {sample}")
    recipe.check("sampled_served_standard", sample["lanes"] == ["standard"] and sample["failed"] == 0
                 and sample["completed"] == a.sampled_requests, sample["lanes"])
    recipe.check("greedy_persistent_meanwhile", greedy["lanes"] == ["persistent"] and greedy["failed"] == 0,
                 greedy["lanes"])
    return {"greedy": greedy, "sampled": sample}


def third(recipe: TwoReplicaRecipe) -> dict:
    """Scale the persistent pool to 3: the third replica must stay pending (no GPU share left)."""
    from ray import serve
    from ray.util import placement_group_table

    a = recipe.args
    pids = sorted(_quanta(recipe))
    recipe.apply(persistent_replicas=3)
    t0 = time.monotonic()
    seen: dict = {}
    while time.monotonic() - t0 < a.pending_s:
        dep = serve.status().applications[APP].deployments[PERSISTENT]
        states = {str(k): v for k, v in dict(dep.replica_states).items()}
        seen = {"replica_states": states, "deployment_status": str(dep.status), "message": dep.message[:400]}
        if states.get("RUNNING", 0) > 2:
            break
        time.sleep(1.0)
    pending = [{"bundles": pg["bundles"], "state": pg["state"]} for pg in placement_group_table().values()
               if pg["state"] != "CREATED" and pg["state"] != "REMOVED" and len(pg["bundles"]) == 2
               and pg["bundles"][1].get("GPU") == a.persistent_gpus]
    r = httpx.post(f"{recipe.base}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": _prompts(recipe, 1, 5)[0], "max_tokens": 16, "temperature": 0})
    still = sorted(_quanta(recipe))
    out = {"watched_s": round(time.monotonic() - t0, 1), **seen, "pending_placement_groups": pending,
           "greedy_lane_while_pending": r.headers.get("x-lane"), "greedy_status": r.status_code,
           "engine_pids_before": pids, "engine_pids_after": still}
    log(f"  third replica: {out}")
    recipe.check("third_replica_pending", seen.get("replica_states", {}).get("RUNNING") == 2
                 and sum(seen.get("replica_states", {}).values()) == 3 and len(pending) == 1,
                 {"states": seen.get("replica_states"), "pending_groups": len(pending)})
    recipe.check("running_replicas_untouched", pids == still and len(still) == 2
                 and r.status_code == 200 and r.headers.get("x-lane") == "persistent",
                 {"before": pids, "after": still, "lane": r.headers.get("x-lane")})
    recipe.apply()  # back to the two the GPUs hold
    t1 = time.monotonic()
    while time.monotonic() - t1 < 60:
        states = dict(serve.status().applications[APP].deployments[PERSISTENT].replica_states)
        if sum(states.values()) == 2 and states.get("RUNNING") == 2:
            break
        time.sleep(0.5)
    out["after_scale_back"] = {str(k): v for k, v in states.items()}
    return out


def report(results: dict) -> str:
    """Markdown of everything measured so far (``report.md``)."""
    lines = [f"Machine: {results.get('machine', '?')}. Ray + Serve started in {results.get('ray_start_s')} s.", ""]
    dep = results.get("deploy") or {}
    if dep:
        lines += [f"App `{json.dumps(dep.get('app', {}), sort_keys=True)}` up (`/health` 200) in "
                  f"{dep.get('startup_s')} s.", ""]
    if results.get("devices"):
        lines += ["| lane | engine pid | CUDA_VISIBLE_DEVICES | Ray GPU ids | cuda device | name | UUID |",
                  "|---|---|---|---|---|---|---|"]
        for r in results["devices"]["engines"]:
            lines.append(f"| {r['lane']} | {r['pid']} | {r['cuda_visible_devices']} | {r['gpu_ids']} | "
                         f"{r['cuda_device']} | {r['cuda_device_name']} | {r['cuda_device_uuid']} |")
        lines.append("")
    t = results.get("tpot")
    if t:
        lines += ["| greedy, persistent lane | TTFT p50 (ms) | TPOT p50 | ITL p50 | E2EL p50 | requests | lanes |",
                  "|---|---|---|---|---|---|---|"]
        rows = [("one stream alone", t["alone"]), ("two streams at once", t["both"])]
        if results.get("sampled"):
            rows.append(("two streams + sampled standard traffic", results["sampled"]["greedy"]))
        for label, s in rows:
            lines.append(f"| {label} | {_ms(s['ttft_p50_ms'])} | {_ms(s['tpot_p50_ms'])} | {_ms(s['itl_p50_ms'])} | "
                         f"{_ms(s['e2el_p50_ms'])} | {s['completed']} ({s['failed']} failed) | {', '.join(s['lanes'])} |")
        lines += ["", f"TPOT two at once / alone: {t['tpot_ratio']}; quanta per persistent engine (pid: count) "
                  f"during the two-stream run: {t['quanta_per_engine']}; greedy requests the router spilled to the "
                  f"standard lane: {t['both'].get('router_spillovers')} of the two-stream run, "
                  f"{(results.get('sampled') or {}).get('greedy', {}).get('router_spillovers')} with sampled traffic.",
                  ""]
    if results.get("sampled"):
        s = results["sampled"]["sampled"]
        lines += [f"Sampled requests meanwhile: {s['completed']} completed, {s['failed']} failed, lanes {s['lanes']}, "
                  f"TTFT p50 {_ms(s['ttft_p50_ms'])} ms, TPOT p50 {_ms(s['tpot_p50_ms'])} ms.", ""]
    if results.get("third"):
        th = results["third"]
        lines += [f"Persistent pool scaled to 3 for {th['watched_s']} s: replica states {th.get('replica_states')}, "
                  f"pending placement groups {len(th['pending_placement_groups'])}, a greedy request meanwhile went "
                  f"{th['greedy_lane_while_pending']}; back to 2: {th.get('after_scale_back')}.", ""]
    if results.get("checks"):
        lines += ["Checks: " + "; ".join(f"{k} {'ok' if v['ok'] else 'FAILED'}" for k, v in results["checks"].items()),
                  ""]
    for key in ("skipped", "errors"):
        if results.get(key):
            lines += [f"{key}: " + "; ".join(e if isinstance(e, str) else f"{e['section']}: {e['error']}"
                                            for e in results[key]), ""]
    return "\n".join(lines)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recipes.gpu_two_replicas", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for summary.json and report.md")
    p.add_argument("--data", default=None, help="unused (gpu_serve.sh passes its carry folder)")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting sections after this many seconds")
    p.add_argument("--persistent-gpus", type=float, default=0.75,
                   help="GPUs per persistent engine (above 0.5: no two share a GPU)")
    p.add_argument("--standard-gpus", type=float, default=0.25, help="GPUs of the standard engine")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (random ids) of the greedy runs")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens per greedy request")
    p.add_argument("--rounds", type=int, default=6, help="greedy requests per stream")
    p.add_argument("--sampled-requests", type=int, default=16)
    p.add_argument("--sampled-concurrency", type=int, default=4)
    p.add_argument("--sampled-tokens", type=int, default=128)
    p.add_argument("--sampled-temperature", type=float, default=0.8)
    p.add_argument("--pending-s", type=float, default=20.0, help="how long the third replica is watched")
    p.add_argument("--num-kv-blocks", type=int, default=1024, help="KV pages per engine")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the same path on CPU: two simulated GPUs, device=cpu engines, eager backend, small runs")
    p.add_argument("--verbose", action="store_true", help="print the Ray workers' logs too")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.prompt_len, args.new_tokens, args.rounds, args.num_kv_blocks = 32, 16, 2, 64
        args.sampled_requests, args.sampled_concurrency, args.sampled_tokens = 4, 2, 8
        args.pending_s = min(args.pending_s, 8.0)
    if args.persistent_gpus <= 0.5 or args.persistent_gpus + args.standard_gpus > 1:
        p.error("--persistent-gpus must exceed 0.5 (one per GPU) and leave room for --standard-gpus on one GPU")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    recipe = TwoReplicaRecipe(args)
    recipe.start()
    try:
        if recipe.fits("deploy"):
            recipe.results["deploy"] = recipe.guarded("deploy", recipe.deploy)
        if recipe.results.get("deploy"):
            for name, fn in (("devices", devices), ("tpot", tpot), ("sampled", sampled), ("third", third)):
                if recipe.fits(name):
                    recipe.results[name] = recipe.guarded(name, fn, recipe)
    finally:
        recipe.save()
        print(report(recipe.results), flush=True)
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    return recipe.results


if __name__ == "__main__":
    main()
