"""What the process that starts the app (``serve run``'s driver, or ``persistent-serve``) checks and sets first.

* :func:`local_model_problem`: the ``model`` option names nothing on this machine (it would otherwise fail in the
  replicas half a minute later, inside Serve's tracebacks).
* :func:`port_problem`: the HTTP port is taken by something that is not this process's Ray Serve. ``serve run`` would otherwise
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


def _starts_new_ray() -> bool:
    """Whether this process's ``ray.init()`` would start a new local Ray instance (no ``RAY_ADDRESS``, no
    cluster of ``ray start``), rather than connect to a running one (Ray's own look-up,
    ``ray._private.services.canonicalize_bootstrap_address``)."""
    try:
        from ray._private import services

        return services.canonicalize_bootstrap_address(None) is None
    except Exception:  # noqa: BLE001 - Ray could not tell: let it try
        return False


def port_problem(host: str, port: int, hint: str) -> str | None:
    """One line saying that ``host:port`` cannot be bound and how to change it (``hint``), or None when it can
    be, or when the Ray Serve holding it is the one this process will connect to (``RAY_ADDRESS``, a cluster of
    ``ray start``), whose proxy it reuses. A Serve of another Ray instance (e.g. an earlier ``make serve`` still
    running) is a problem: a new Ray instance's proxy could never bind the port, and the app would wait."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT does not count
        try:
            s.bind((host, port))
            return None
        except OSError as exc:
            reason = exc.strerror or str(exc)
    if _is_serve_proxy(host, port):
        if not _starts_new_ray():
            return None
        return (f"cannot serve HTTP on {host}:{port}: another Ray Serve instance (an earlier `make serve` or "
                f"`serve run` still running?) serves there, and this command would start a new Ray instance whose "
                f"proxy cannot bind it; stop that one (Ctrl-C in its shell), or {hint}")
    return f"cannot serve HTTP on {host}:{port}: {reason} (another server holds the port?); {hint}"


def keep_span_lines_whole() -> None:
    """Turn off Ray's log deduplication in this driver process (it prints the replicas' output): spans printed
    by the ``console`` exporter are then printed whole. Also exported as ``RAY_DEDUP_LOGS=0`` for drivers
    started from here."""
    os.environ["RAY_DEDUP_LOGS"] = "0"
    import ray._private.ray_logging as ray_logging

    ray_logging.RAY_DEDUP_LOGS = False  # read at each batch by LogDeduplicator.deduplicate


def local_model_problem(model: str) -> str | None:
    """:func:`replicas.models.loader.model_problem` for a driver about to start Ray on this machine; None when
    ``RAY_ADDRESS`` names a cluster, whose workers may hold the path this machine does not."""
    if os.environ.get("RAY_ADDRESS"):
        return None
    from replicas.models.loader import model_problem

    return model_problem(model)


def prepare_serve_run_driver(console_tracing: bool, model: str | None = None) -> None:
    """In ``serve run``'s process before it starts Ray: exit with one line when ``model`` names nothing here
    (:func:`local_model_problem`) or the port is taken, and keep console spans whole. Does nothing elsewhere.

    Raises:
        SystemExit: 2 for a model that is not there, 1 when the HTTP port cannot be bound.
    """
    if not in_serve_run_driver():
        return
    problem = local_model_problem(model) if model is not None else None
    if problem:
        print(f"serve run: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    problem = port_problem(*serve_run_http_address(), SERVE_RUN_PORT_HINT)
    if problem:
        print(f"serve run: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if console_tracing:
        keep_span_lines_whole()
