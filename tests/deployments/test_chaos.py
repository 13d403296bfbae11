"""Chaos on a real multi-node Ray cluster (CI stage ``make test-chaos``): processes and a node die
under load, over real HTTP; each test prints one ``chaos:`` JSON line with its numbers
(docs/reliability.md holds them).

``ray.cluster_utils.Cluster``: a head (no GPU: controller, proxy, ingress) and three worker nodes
with one simulated GPU each; engines run on CPU (``device=cpu``) while Ray accounts GPUs as on a
GPU cluster. The app: two persistent replicas (one GPU each, so one spare GPU node) and two standard
replicas that hold 8 requests each with 8 more queued at the ingress. Faults, in order:

1. ``SIGKILL`` the engine actors serving a persistent-lane and a standard-lane stream;
2. ``SIGKILL`` one standard replica under 16 concurrent streams;
3. ``SIGKILL`` the ingress replica with streams in flight;
4. 3x capacity of mixed-lane clients for 60 s;
5. remove a worker node (its raylet and every process on it) under load.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.chaos]

APP = "chaos"
MODEL = "smollm2-135m-instruct"
GPU_NODES = 3
PERSISTENT, STANDARD, ONGOING, QUEUED = 2, 2, 8, 8
CAPACITY = PERSISTENT + STANDARD * ONGOING + QUEUED
"""Requests the app holds at once: one per persistent replica, 8 per standard replica, 8 queued."""
ERROR_BOUND_S = 15.0
"""A stream whose process died ends with an error event and ``[DONE]`` within this (stated in docs)."""
ASK = [{"role": "user", "content": "Count from one to two hundred in words."}]
RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def chaos():
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_app
    from tests.deployments.conftest import _free_port, serve_status_wait, wait_healthy

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "num_gpus": 0})
    for _ in range(GPU_NODES):
        cluster.add_node(num_cpus=2, num_gpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    port = _free_port()
    # proxy on the head only: every node of this one-machine cluster would bind the same port (SO_REUSEPORT),
    # so the client's connections would land on worker nodes' proxies and die with the node under test 5
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    start = time.monotonic()
    serve.run(build_app({
        "device": "cpu", "max_model_len": 512, "num_kv_blocks": 160, "progress": False, "engine_num_cpus": 0.25,
        "persistent_pool": {"min_replicas": PERSISTENT, "max_replicas": PERSISTENT, "num_gpus": 1,
                            "health_check_period_s": 2},
        "standard_pool": {"min_replicas": STANDARD, "max_replicas": STANDARD, "num_gpus": 0,
                          "max_ongoing_requests": ONGOING, "max_queued_requests": QUEUED,
                          "health_check_period_s": 2},
    }), name=APP, route_prefix="/", blocking=False)
    serve_status_wait(APP, timeout=300)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base)
    print(f"\nchaos app up in {time.monotonic() - start:.1f} s")
    yield {"base": base, "cluster": cluster}
    print("\nchaos results:", json.dumps(RESULTS))
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


# ---- helpers -------------------------------------------------------------------------------------

def _stats(base: str) -> dict:
    """``/debug/stats``; an error status raises ``httpx.HTTPStatusError`` (which :func:`_wait` retries: while a
    node's replicas are rescheduled Serve's proxy may answer 5xx with a body that is not JSON)."""
    r = httpx.get(f"{base}/debug/stats", timeout=30)
    r.raise_for_status()
    return r.json()


def _engines(base: str, lane: str) -> list[dict]:
    return _stats(base)[lane]["engines"]


def _actors() -> list[dict]:
    import ray

    return [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]


def _replica_of(engine_pid: int) -> dict:
    """The Serve replica actor that owns the engine actor in process ``engine_pid``."""
    actors = _actors()
    engine = next(a for a in actors if a["Pid"] == engine_pid)
    owner = engine["OwnerAddress"]
    return next(a for a in actors if a["Address"]["Port"] == owner["Port"]
                and a["Address"]["IPAddress"] == owner["IPAddress"])


def _pids_on_node(node_id: str) -> list[int]:
    """Process ids of the live actors on Ray node ``node_id``."""
    return [a["Pid"] for a in _actors() if a["Address"]["NodeID"] == node_id and a["Pid"]]


def _alive(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait(predicate, timeout: float, what: str, period: float = 0.5):
    deadline = time.monotonic() + timeout
    last_error = None
    while True:
        try:
            value = predicate()
        except httpx.HTTPError as exc:
            value, last_error = None, exc
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what} (last: {last_error!r})"
        time.sleep(period)


def _pages_back(base: str, lanes=("standard", "persistent"), replicas=None) -> bool:
    stats = _stats(base)
    for lane in lanes:
        s = stats[lane]
        if s["kv_pages_free"] != s["kv_pages_total"]:
            return False
        if replicas is not None and s["replicas"] != replicas[lane]:
            return False
    return True


async def _stream(client: httpx.AsyncClient, base: str, body: dict, seen: asyncio.Event | None = None,
                  min_chunks: int = 3) -> dict:
    """One streamed chat request: its lane, content chunks, the error event and whether ``[DONE]`` came."""
    out = {"lane": None, "chunks": 0, "error": None, "done": False, "transport": None, "finish": None,
           "end": None}
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", timeout=300,
                                 json={"model": MODEL, "messages": ASK, "stream": True, **body}) as r:
            out["lane"], out["status"] = r.headers.get("x-lane"), r.status_code
            out["retry_after"] = r.headers.get("retry-after")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out["done"] = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    out["error"], out["error_at"] = event["error"], time.monotonic()
                    continue
                for choice in event["choices"]:
                    if choice["delta"].get("content"):
                        out["chunks"] += 1
                        out.setdefault("first_at", time.monotonic())
                    out["finish"] = choice.get("finish_reason") or out["finish"]
                if seen is not None and out["chunks"] >= min_chunks:
                    seen.set()
    except httpx.HTTPError as exc:
        out["transport"] = f"{type(exc).__name__}: {exc}"
    out["end"] = time.monotonic()
    if seen is not None:
        seen.set()
    return out


def _engines_idle() -> bool:
    """Every engine of the app has no request and a full KV pool, read from the engine actors directly
    (``/debug/stats`` is served by the ingress, which may be the process that died)."""
    import ray

    from deployments.replicas import _live_engine_actors

    stats = [ray.get(a.stats.remote(), timeout=10) for lane in ("standard", "persistent")
             for a in _live_engine_actors(lane, APP)]
    return bool(stats) and all(not s["running"] and s["kv_pages_free"] == s["kv_pages_total"] for s in stats)


def _chat(base: str, headers=None, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", headers=headers or {}, timeout=120,
                      json={"model": MODEL, "messages": ASK, "max_tokens": 8, **body})


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


# ---- 1. engine SIGKILL mid-stream, each lane --------------------------------------------------------

LANES = ("persistent", "standard")
REPLICAS = {"persistent": PERSISTENT, "standard": STANDARD}


def test_sigkill_the_engine_serving_a_stream_on_each_lane(chaos):
    """A greedy stream (persistent lane) and a sampled one (standard lane) at once; the engine actor
    serving each is SIGKILLed. Both lanes in one run: one recovery wait instead of two."""
    base = chaos["base"]
    bodies = {"persistent": {"temperature": 0, "max_tokens": 400, "ignore_eos": True},
              "standard": {"temperature": 0.8, "seed": 1, "max_tokens": 400, "ignore_eos": True}}
    before = {lane: {e["pid"] for e in _engines(base, lane)} for lane in LANES}
    assert {lane: len(p) for lane, p in before.items()} == REPLICAS

    async def main():
        async with httpx.AsyncClient() as c:
            seen = {lane: asyncio.Event() for lane in LANES}
            tasks = {lane: asyncio.create_task(_stream(c, base, bodies[lane], seen[lane])) for lane in LANES}
            await asyncio.gather(*(e.wait() for e in seen.values()))
            stats = await asyncio.to_thread(_stats, base)
            victims = {}
            for lane in LANES:
                (victims[lane],) = [e for e in stats[lane]["engines"] if e["running"]]
            killed_at = time.monotonic()
            for victim in victims.values():
                os.kill(victim["pid"], signal.SIGKILL)
            return {lane: await t for lane, t in tasks.items()}, victims, killed_at

    results, victims, killed_at = asyncio.run(main())
    record = {}
    for lane, result in results.items():
        assert result["lane"] == lane and result["chunks"] >= 3, result
        assert result["error"] is not None and result["error"]["code"] == "engine_died", result
        assert result["done"] and result["transport"] is None, result  # an error event, then the stream's end
        record[lane] = {"error_event_after_s": round(result["error_at"] - killed_at, 2),
                        "chunks_before_kill": result["chunks"], "lost_requests": 1}
        assert result["error_at"] - killed_at < ERROR_BOUND_S

    # Ray restarts each engine in its bundle: a new process, its KV pool full, serving again
    for lane in LANES:
        def back(lane=lane):
            engines = _engines(base, lane)
            pids = {e["pid"] for e in engines}
            return len(engines) == REPLICAS[lane] and victims[lane]["pid"] not in pids and engines

        engines = _wait(back, 180, f"the {lane} engine to come back")
        record[lane]["engine_back_after_s"] = round(time.monotonic() - killed_at, 1)
        assert all(e["kv_pages_free"] == e["kv_pages_total"] for e in engines)

    def both_persistent_replicas_serve():  # two greedy requests at once: each persistent replica takes one
        async def two():
            async with httpx.AsyncClient() as c:
                return await asyncio.gather(*(c.post(f"{base}/v1/chat/completions", timeout=120, json={
                    "model": MODEL, "messages": ASK, "max_tokens": 24, "ignore_eos": True, "temperature": 0})
                    for _ in range(PERSISTENT)))
        rs = asyncio.run(two())
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return all(r.headers["x-lane"] == "persistent" for r in rs)

    _wait(both_persistent_replicas_serve, 90, "both persistent replicas to serve again", period=1)
    record["persistent"]["all_replicas_serving_after_s"] = round(time.monotonic() - killed_at, 1)
    assert _chat(base, temperature=0.7).status_code == 200
    record["standard"]["next_request_ok_after_s"] = round(time.monotonic() - killed_at, 1)
    _wait(lambda: _pages_back(base), 30, "every KV page back")  # no drift in the survivors
    for lane in LANES:
        RESULTS[f"engine_kill_{lane}"] = record[lane]
    print("\nchaos:", json.dumps({f"engine_kill_{lane}": record[lane] for lane in LANES}))


# ---- 2. a standard replica under 16 concurrent streams ------------------------------------------------

def test_kill_a_standard_replica_under_16_streams_fails_only_its_requests(chaos):
    base = chaos["base"]
    streams = 16

    async def main():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as c:
            seen = [asyncio.Event() for _ in range(streams)]
            tasks = [asyncio.create_task(_stream(c, base, {"temperature": 0.8, "seed": i, "max_tokens": 240,
                                                           "ignore_eos": True}, seen[i], min_chunks=1))
                     for i in range(streams)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in seen)), 120)
            asked_at = time.monotonic()
            engines = await asyncio.to_thread(_engines, base, "standard")
            answered_at = time.monotonic()
            for e in engines:  # a preempted request waits (recompute) but is still on that engine
                e["holding"] = e["running"] + e["waiting"]
            victim = max(engines, key=lambda e: e["holding"])
            replica = await asyncio.to_thread(_replica_of, victim["pid"])
            killed_at = time.monotonic()
            os.kill(replica["Pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks), engines, victim, killed_at, (asked_at, answered_at)

    results, engines, victim, killed_at, (asked_at, answered_at) = asyncio.run(main())
    # A stream that had ended before the engines were asked is on no engine; one that ended while they
    # were being asked (or whose last chunk was still on its way) may or may not have been counted.
    # Every other stream was on exactly one engine.
    ended_before = sum(r["end"] < asked_at for r in results)
    maybe_ended = sum(asked_at <= r["end"] < answered_at + 0.5 for r in results)
    holding = sum(e["holding"] for e in engines)
    assert streams - ended_before - maybe_ended <= holding <= streams - ended_before, (
        holding, ended_before, maybe_ended, engines)
    # Serve's back-pressure may refuse a few of the burst's requests before they reach a replica (more than
    # max_queued_requests waiting for a slot at one moment): a 503 with Retry-After, on no engine
    refused = [r for r in results if r.get("status") == 503]
    assert all(r["retry_after"] and not r["chunks"] and r["error"] is None for r in refused), refused
    admitted = streams - len(refused)
    failed = [r for r in results if r["error"] is not None]
    completed = [r for r in results if r["finish"] == "length" and r["error"] is None]
    assert len(failed) == victim["holding"], (len(failed), victim["holding"], engines)
    assert len(completed) == admitted - victim["holding"], (results, engines)  # the other replica's all finished
    assert len(completed) >= 1 and admitted >= streams // 2, (len(completed), admitted)
    for r in failed:
        assert r["error"]["code"] == "replica_died" and r["done"] and r["transport"] is None, r
        assert r["error_at"] - killed_at < ERROR_BOUND_S
    _wait(lambda: _pages_back(base, replicas={"standard": STANDARD, "persistent": PERSISTENT}), 180,
          "Serve to replace the standard replica")
    replaced_after = time.monotonic() - killed_at
    assert _chat(base, temperature=0.7).status_code == 200
    RESULTS["standard_replica_kill"] = {
        "streams": streams, "refused_503": len(refused), "on_killed_replica": victim["holding"], "failed": len(failed),
        "completed": len(completed), "error_events_after_s": round(max(r["error_at"] for r in failed) - killed_at, 2),
        "replaced_after_s": round(replaced_after, 1)}
    print("\nchaos:", json.dumps({"standard_replica_kill": RESULTS["standard_replica_kill"]}))


# ---- 3. the ingress replica --------------------------------------------------------------------------

def test_restart_the_ingress_replica(chaos):
    base = chaos["base"]
    max_tokens = 250
    bodies = [{"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}] + [
        {"temperature": 0.8, "seed": i, "max_tokens": max_tokens, "ignore_eos": True} for i in range(3)]

    async def main():
        async with httpx.AsyncClient() as c:
            seen = [asyncio.Event() for _ in bodies]
            tasks = [asyncio.create_task(_stream(c, base, b, seen[i], min_chunks=1)) for i, b in enumerate(bodies)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in seen)), 120)
            await asyncio.sleep(2)  # a few tokens, to estimate the decode rate
            (ingress,) = [a for a in await asyncio.to_thread(_actors)
                          if a["Name"].startswith(f"SERVE_REPLICA::{APP}#OpenAIIngress#")]
            killed_at = time.monotonic()
            os.kill(ingress["Pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks), killed_at

    results, killed_at = asyncio.run(main())
    for r in results:  # in flight on the dead process: the stream breaks off, the client sees it at once
        assert not r["done"] and (r["transport"] or r["error"]), r
        assert r["end"] - killed_at < ERROR_BOUND_S, r
    failed_after = max(r["end"] for r in results) - killed_at
    # the replicas notice the dead ingress and stop its requests' engine work: every page comes back
    _wait(_engines_idle, 120, "the engines to stop the dead ingress's requests")
    stopped_after = time.monotonic() - killed_at
    # how long the engines would still have decoded for the dead ingress (standard lane: a chunk is a token)
    sampled = [r for r in results[1:] if r["chunks"] > 1]
    rate = min(r["chunks"] / max(killed_at - r["first_at"], 1e-3) for r in sampled)
    left_s = (max_tokens - min(r["chunks"] for r in sampled)) / rate

    def served():
        r = _chat(base, temperature=0)
        return r.status_code == 200

    _wait(served, 120, "a new ingress replica to serve", period=0.5)
    served_after = time.monotonic() - killed_at
    _wait(lambda: _pages_back(base), 60, "every KV page back, seen through the new ingress")
    assert stopped_after < left_s, (stopped_after, left_s)  # stopped, not decoded to the end for nobody
    RESULTS["ingress_kill"] = {"in_flight": len(results), "failed": len(results),
                               "client_saw_failure_after_s": round(failed_after, 2),
                               "client_saw": sorted({(r["transport"] or "error event").split(":")[0] for r in results}),
                               "new_requests_served_after_s": round(served_after, 1),
                               "engine_work_stopped_after_s": round(stopped_after, 1),
                               "decode_left_at_kill_s_estimate": round(left_s, 1)}
    print("\nchaos:", json.dumps({"ingress_kill": RESULTS["ingress_kill"]}))


# ---- 4. overload: 3x capacity, mixed lanes, 60 s -----------------------------------------------------

def test_overload_at_3x_capacity_for_60_s(chaos):
    base = chaos["base"]
    clients, duration_s = 3 * CAPACITY, 60.0
    counts = {"ok": 0, "refused": 0, "bad": []}
    lanes: dict[str, int] = {}
    pids = {a["Pid"]: a["Name"] for a in _actors() if a["Name"].startswith(("SERVE_", "persistent-serve-engine"))}
    engines_before = {e["pid"] for lane in ("standard", "persistent") for e in _engines(base, lane)}
    rss: list[dict[int, float]] = []

    async def client(c: httpx.AsyncClient, i: int, stop_at: float):
        kind = i % 3  # greedy (persistent-eligible), sampled, streamed sampled
        while time.monotonic() < stop_at:
            body = {"model": MODEL, "messages": ASK, "max_tokens": 16,
                    **({"temperature": 0} if kind == 0 else {"temperature": 0.8, "seed": i})}
            try:
                if kind == 2:
                    r = await _stream(c, base, {k: v for k, v in body.items() if k not in ("model", "messages")})
                    status = r.get("status")
                    good = status == 200 and r["finish"] in ("length", "stop") and r["done"]
                    retry_after = r["retry_after"]  # a 503 before streaming is an ordinary JSON error
                else:
                    resp = await c.post(f"{base}/v1/chat/completions", json=body, timeout=300)
                    status = resp.status_code
                    good = status == 200 and resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
                    retry_after = resp.headers.get("retry-after")
                    if status == 200:
                        lanes[resp.headers["x-lane"]] = lanes.get(resp.headers["x-lane"], 0) + 1
                    if status in (429, 503):
                        assert resp.json()["error"]["code"] == "overloaded", resp.text
            except httpx.HTTPError as exc:
                counts["bad"].append(f"{type(exc).__name__}: {exc}")
                continue
            if good:
                counts["ok"] += 1
            elif status in (429, 503) and retry_after is not None:
                counts["refused"] += 1
                await asyncio.sleep(float(retry_after))  # a polite client honours Retry-After
            else:
                counts["bad"].append(f"status {status}")

    async def sample(stop_at: float):
        while time.monotonic() < stop_at:
            rss.append({pid: _rss_mb(pid) for pid in pids})
            await asyncio.sleep(5)

    async def main():
        stop_at = time.monotonic() + duration_s
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients * 2)) as c:
            await asyncio.gather(sample(stop_at), *(client(c, i, stop_at) for i in range(clients)))

    start = time.monotonic()
    asyncio.run(main())
    took = time.monotonic() - start
    assert not counts["bad"], counts["bad"][:10]
    assert counts["ok"] > 0 and counts["refused"] > 0, counts
    _wait(lambda: _pages_back(base, replicas={"standard": STANDARD, "persistent": PERSISTENT}), 60,
          "every page back after the overload")
    # memory: the growth of each Serve/engine process from the first sample (load on) to the last
    first, last = rss[1] if len(rss) > 1 else rss[0], rss[-1]
    growth = {pids[p]: round(last[p] - first[p], 1) for p in first if first[p] and last.get(p)}
    worst_name = max(growth, key=growth.get)
    worst = growth[worst_name]
    assert worst < 200, growth  # MB: bounded, no per-request leak (78 clients x ~1k requests)
    engines_after = {e["pid"] for lane in ("standard", "persistent") for e in _engines(base, lane)}
    assert engines_after == engines_before  # no engine crashed or restarted under the overload
    RESULTS["overload"] = {"clients": clients, "capacity": CAPACITY, "duration_s": round(took, 1),
                           "completed": counts["ok"], "refused_503": counts["refused"], "other": 0,
                           "completed_by_lane": lanes, "max_rss_growth_mb": worst,
                           "max_rss_growth_process": worst_name.split("@")[0].split("#")[:2],
                           "rss_mb_end": {pids[p]: round(v) for p, v in last.items() if v}}
    print("\nchaos:", json.dumps({"overload": RESULTS["overload"]}))


# ---- 5. a worker node dies ---------------------------------------------------------------------------

def test_kill_a_worker_node_under_load_reschedules_its_persistent_replica(chaos):
    base, cluster = chaos["base"], chaos["cluster"]
    from ray import serve

    engines = _engines(base, "persistent")
    assert len(engines) == PERSISTENT
    victim_node = engines[0]["node_id"]
    node = next(n for n in cluster.worker_nodes if n.node_id == victim_node)
    outcome = {"ok": 0, "failed_in_flight": 0, "failed_after": []}
    stop = asyncio.Event()
    killed: dict = {}

    async def user(c: httpx.AsyncClient, i: int):
        while not stop.is_set():
            started = time.monotonic()
            body = {"model": MODEL, "messages": ASK, "max_tokens": 24, "ignore_eos": True,
                    **({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": i})}
            try:
                r = await c.post(f"{base}/v1/chat/completions", json=body, timeout=300)
                ok = r.status_code == 200
                why = r.text[:200]
            except httpx.HTTPError as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            if ok:
                outcome["ok"] += 1
            elif "at" in killed and started <= killed.get("done", float("inf")):
                outcome["failed_in_flight"] += 1  # it was running while its node's processes were killed
            else:
                outcome["failed_after"].append(why)

    async def main():
        async with httpx.AsyncClient() as c:
            users = [asyncio.create_task(user(c, i)) for i in range(4)]
            await asyncio.sleep(8)
            doomed = _pids_on_node(victim_node)
            killed["at"] = time.monotonic()
            await asyncio.to_thread(cluster.remove_node, node, False)
            # remove_node returns once the node's raylet is killed; its workers exit when they notice, so a
            # request may still reach (and start on) the dying replica for a moment: the node is dead once
            # every process of it has exited
            await asyncio.to_thread(_wait, lambda: not any(_alive(p) for p in doomed), 60,
                                    "the dead node's worker processes to exit")
            killed["done"] = time.monotonic()

            def recovered():
                app = serve.status().applications[APP].deployments["PersistentReplica"]
                if app.replica_states.get("RUNNING", 0) != PERSISTENT:
                    return False
                es = _engines(base, "persistent")
                return len(es) == PERSISTENT and victim_node not in {e["node_id"] for e in es} and es

            es = await asyncio.to_thread(_wait, recovered, 180, "the persistent replica on a remaining GPU node")
            killed["recovered_after"] = time.monotonic() - killed["at"]
            killed["nodes"] = sorted({e["node_id"] for e in es})
            await asyncio.sleep(5)  # keep the load on the rescheduled pool for a moment
            stop.set()
            await asyncio.gather(*users)

    asyncio.run(main())
    assert len(killed["nodes"]) == PERSISTENT and victim_node not in killed["nodes"]
    assert not outcome["failed_after"], outcome["failed_after"][:5]  # only what ran on the dead node failed
    assert outcome["ok"] > 0
    _wait(lambda: _pages_back(base), 60, "every page back after the node died")
    r = _chat(base, temperature=0)
    assert r.status_code == 200
    RESULTS["node_kill"] = {"recovered_after_s": round(killed["recovered_after"], 1), "completed": outcome["ok"],
                            "failed_in_flight": outcome["failed_in_flight"], "failed_after": 0,
                            "gpu_nodes_left": GPU_NODES - 1}
    print("\nchaos:", json.dumps({"node_kill": RESULTS["node_kill"]}))
