"""Bounded soak: N mixed requests against a running app; counts lost requests and leaked KV pages.

Mix (cycled by request index): greedy chat (persistent lane), sampled chat,
streamed greedy chat, ``n=2`` completions, stop-string chat, a client that
disconnects mid-stream, and malformed requests (expected 4xx). A request is
*lost* when it gets no response, a 5xx, a 200 without a finish reason, or a
status other than the one expected. Leaked pages are read from ``/debug/stats``
once the load has stopped (every lane's ``kv_pages_free == kv_pages_total``).

Usage::

    python -m ops.tools.soak --url http://127.0.0.1:8000 --requests 1000 --concurrency 16

Prints one JSON line with the counts and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter

import httpx
from tqdm import tqdm

MODEL = "smollm2-135m-instruct"
_MSG = [{"role": "user", "content": "Name a colour."}]


def _kinds(model: str) -> list[tuple[str, str, dict, int]]:
    """(kind, path, body, expected status) cycled over the soak."""
    chat = {"model": model, "messages": _MSG, "max_tokens": 8}
    return [
        ("greedy", "/v1/chat/completions", {**chat, "temperature": 0}, 200),
        ("sampled", "/v1/chat/completions", {**chat, "temperature": 0.9, "seed": 7}, 200),
        ("stream", "/v1/chat/completions", {**chat, "temperature": 0, "stream": True}, 200),
        ("n2", "/v1/completions", {"model": model, "prompt": "Red, green,", "max_tokens": 6, "n": 2,
                                    "temperature": 0.7}, 200),
        ("stop", "/v1/chat/completions", {**chat, "temperature": 0, "stop": ["."]}, 200),
        ("disconnect", "/v1/chat/completions", {**chat, "max_tokens": 200, "ignore_eos": True,
                                                 "temperature": 0.5, "stream": True}, 200),
        ("bad", "/v1/chat/completions", {"model": model, "messages": "not a list"}, 400),
    ]


async def _one(client: httpx.AsyncClient, url: str, kind: str, path: str, body: dict, expected: int) -> str:
    """Run one request; return ``"ok"`` or why it counts as lost."""
    try:
        if body.get("stream"):
            async with client.stream("POST", url + path, json=body) as r:
                if r.status_code != expected:
                    return f"status {r.status_code}"
                seen_finish = False
                async for line in r.aiter_lines():
                    if kind == "disconnect" and line.startswith("data: "):
                        return "ok"  # go away mid-stream: the server must abort and free the pages
                    if '"finish_reason":"' in line.replace(" ", ""):
                        seen_finish = True
                return "ok" if seen_finish else "no finish_reason"
        r = await client.post(url + path, json=body)
        if r.status_code != expected:
            return f"status {r.status_code}"
        data = r.json()
        if expected != 200:
            return "ok" if set(data.get("error", {})) >= {"message", "type", "param", "code"} else "bad error body"
        finishes = [c.get("finish_reason") for c in data["choices"]]
        return "ok" if finishes and all(finishes) and len(finishes) == body.get("n", 1) else "no finish_reason"
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}"


async def leaked_pages(client: httpx.AsyncClient, url: str, settle_s: float = 15.0) -> int:
    """KV pages still in use once traffic stopped (0 = no leak), polled for up to ``settle_s``."""
    deadline = time.monotonic() + settle_s
    while True:
        stats = (await client.get(url + "/debug/stats")).json()
        used = sum(s["kv_pages_total"] - s["kv_pages_free"] for k, s in stats.items()
                   if k in ("standard", "persistent"))
        if used == 0 or time.monotonic() > deadline:
            return used
        await asyncio.sleep(0.25)


async def soak(url: str, requests: int = 1000, concurrency: int = 16, model: str = MODEL,
               progress: bool = True) -> dict:
    """Run the soak; returns counts: ``sent``, ``ok``, ``lost`` (with reasons), ``leaked_pages``,
    ``wall_s``, ``per_kind``."""
    kinds = _kinds(model)
    sem = asyncio.Semaphore(concurrency)
    outcomes: Counter = Counter()
    per_kind: Counter = Counter()
    bar = tqdm(total=requests, disable=not progress, desc="soak")
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        async def run(i: int) -> None:
            kind, path, body, expected = kinds[i % len(kinds)]
            async with sem:
                result = await _one(client, url, kind, path, body, expected)
            outcomes[result] += 1
            per_kind[kind] += 1
            bar.update()

        start = time.monotonic()
        await asyncio.gather(*(run(i) for i in range(requests)))
        wall = time.monotonic() - start
        bar.close()
        leaked = await leaked_pages(client, url)
        router = (await client.get(url + "/debug/stats")).json().get("router", {})
    lost = {k: v for k, v in outcomes.items() if k != "ok"}
    return {"sent": requests, "ok": outcomes["ok"], "lost": sum(lost.values()), "lost_reasons": lost,
            "leaked_pages": leaked, "wall_s": round(wall, 1), "requests_per_s": round(requests / wall, 1),
            "concurrency": concurrency, "per_kind": dict(per_kind), "router": router}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--model", default=MODEL)
    a = p.parse_args(argv)
    result = asyncio.run(soak(a.url, a.requests, a.concurrency, a.model))
    print(json.dumps(result))
    return 0 if result["lost"] == 0 and result["leaked_pages"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
