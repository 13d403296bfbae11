"""Measure what one Ray hop costs on the serving path (why the router lives in the ingress).

Starts a local Ray cluster, deploys the app on the embedded model, then times
(median and p90 over ``--iters`` calls, milliseconds):

* ``actor``: driver → engine actor ``stats()`` (one actor hop);
* ``replica``: driver → PersistentReplica ``stats()`` via a Serve handle, which
  forwards to its actor (one Serve hop + one actor hop);
* ``http_health``: HTTP ``GET /health`` (proxy → ingress);
* ``http_1_token``: HTTP greedy chat with ``max_tokens=1`` (proxy → ingress →
  replica → actor → prefill), and the same request's engine time alone.

Usage: ``python -m ops.bench.hops --iters 200``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time


def _summary(samples: list[float]) -> str:
    s = sorted(samples)
    return f"median {statistics.median(s) * 1e3:7.2f} ms   p90 {s[int(0.9 * (len(s) - 1))] * 1e3:7.2f} ms"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--port", type=int, default=8123)
    args = p.parse_args(argv)

    import httpx
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app({"progress": False}), name="bench", route_prefix="/")
    replica = serve.get_deployment_handle("PersistentReplica", app_name="bench")
    base = f"http://127.0.0.1:{args.port}"
    chat = {"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hi"}]}

    async def run() -> dict[str, list[float]]:
        named = ray.util.list_named_actors(all_namespaces=True)
        entry = next(a for a in named if a["name"].startswith("persistent-serve-engine-persistent"))
        actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
        out: dict[str, list[float]] = {"actor": [], "replica": [], "http_health": [], "http_1_token": []}
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            for _ in range(args.iters):
                if actor is not None:
                    t = time.perf_counter()
                    await actor.stats.remote()
                    out["actor"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await replica.stats.remote()
                out["replica"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await client.get("/health")
                out["http_health"].append(time.perf_counter() - t)
            for _ in range(max(10, args.iters // 10)):
                t = time.perf_counter()
                r = await client.post("/v1/chat/completions", json=chat)
                r.raise_for_status()
                out["http_1_token"].append(time.perf_counter() - t)
        return out

    results = asyncio.run(run())
    print(f"\nRay hop latency ({args.iters} iterations, local cluster)")
    for name, samples in results.items():
        if samples:
            print(f"  {name:14s} {_summary(samples)}")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
