"""What the process that starts the app (``serve run``'s driver, or ``persistent-serve``) checks and sets first.

* :func:`port_problem`: the HTTP port is taken by something that is not Ray Serve. ``serve run`` would otherwise
  start Ray and end in a long traceback from Serve's proxy; this says it in one line, with the option that
  changes the port.
* :func:`keep_span_lines_whole`: with the ``console`` trace exporter, Ray's log deduplication on the driver
  (lines that look alike across processes, "[repeated Nx across cluster]") would cut the printed spans; it is
  turned off in this driver so every span line is printed.

Both act only in a driver before it connects to Ray (:func:`in_serve_run_driver`), never in Serve's replicas.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

SERVE_RUN_PORT_HINT = ("serve another port with `persistent-serve --port 8001` (every `serve run` argument is a "
                       "flag there too), or a Serve config file's `http_options.port` (`serve run "
                       "deploy/serve_config.laptop.yaml`); `serve run IMPORT_PATH` always uses 8000")
"""How to change the port, as the one-line error says it to a ``serve run`` user."""


def in_serve_run_driver() -> bool:
    """True in the ``serve run IMPORT_PATH`` command's own process, before it has connected to Ray."""
    import ray

    return (Path(sys.argv[0]).name == "serve" and sys.argv[1:2] == ["run"]
            and not ray.is_initialized())


def serve_run_http_address() -> tuple[str, int]:
    """The host and port ``serve run IMPORT_PATH`` makes Serve's proxy listen on (Serve's defaults)."""
    from ray.serve._private import constants

    return constants.DEFAULT_HTTP_HOST or "127.0.0.1", int(constants.DEFAULT_HTTP_PORT)


def _is_serve_proxy(host: str, port: int) -> bool:
    """Whether ``host:port`` answers Serve's proxy health route (an existing Serve that ``serve run`` reuses)."""
    import httpx

    try:
        r = httpx.get(f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/-/healthz", timeout=1.0)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and r.text.strip() == "success"


def port_problem(host: str, port: int, hint: str) -> str | None:
    """One line saying that ``host:port`` cannot be bound and how to change it (``hint``), or None when it can
    be (or when Ray Serve itself holds it: a running Serve instance is reused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT does not count
        try:
            s.bind((host, port))
            return None
        except OSError as exc:
            reason = exc.strerror or str(exc)
    if _is_serve_proxy(host, port):
        return None
    return f"cannot serve HTTP on {host}:{port}: {reason} (another server holds the port?); {hint}"


def keep_span_lines_whole() -> None:
    """Turn off Ray's log deduplication in this driver process (it prints the replicas' output): spans printed
    by the ``console`` exporter are then printed whole. Also exported as ``RAY_DEDUP_LOGS=0`` for drivers
    started from here."""
    os.environ["RAY_DEDUP_LOGS"] = "0"
    import ray._private.ray_logging as ray_logging

    ray_logging.RAY_DEDUP_LOGS = False  # read at each batch by LogDeduplicator.deduplicate


def prepare_serve_run_driver(console_tracing: bool) -> None:
    """In ``serve run``'s process before it starts Ray: exit with one line when the port is taken, and keep
    console spans whole. Does nothing elsewhere.

    Raises:
        SystemExit: 1 when the HTTP port cannot be bound.
    """
    if not in_serve_run_driver():
        return
    problem = port_problem(*serve_run_http_address(), SERVE_RUN_PORT_HINT)
    if problem:
        print(f"serve run: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if console_tracing:
        keep_span_lines_whole()
