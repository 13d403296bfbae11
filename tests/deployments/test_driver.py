"""What ``serve run``'s own process and ``persistent-serve`` check before they start Ray (``deployments/driver.py``):
a taken HTTP port is one line naming the option that changes it, not Ray's traceback; and with the console trace
exporter Ray's log deduplication no longer cuts the printed spans. Real commands in subprocesses, no Ray started."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

# `serve run IMPORT_PATH` (Ray's own click command) with Serve's default port replaced by ours
SERVE_RUN = """
import sys
import ray.serve._private.constants as c
c.DEFAULT_HTTP_PORT = {port}
sys.argv = ["serve", "run", {target!r}] + {args!r}
from ray.serve.scripts import cli
cli()
"""


@pytest.fixture
def taken_port():
    """A port some other server (not Ray Serve) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _run(code_or_argv, timeout=120) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", code_or_argv] if isinstance(code_or_argv, str) else [sys.executable, *code_or_argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "cannot serve HTTP" in line]


def test_serve_run_on_a_taken_port_says_so_in_one_line(taken_port):
    p = _run(SERVE_RUN.format(port=taken_port, target="deployments.app:app", args=[]))
    assert p.returncode == 1, (p.stdout, p.stderr)
    [line] = _error_lines(p.stderr)
    assert line.startswith(f"serve run: cannot serve HTTP on 127.0.0.1:{taken_port}: ") and "--port" in line
    assert "Traceback" not in p.stderr and "Started a local Ray instance" not in p.stderr + p.stdout


@pytest.fixture
def serve_like_port():
    """A port where something answers Ray Serve's proxy health route as Serve does (an earlier ``make serve``
    of another Ray instance, as a new user leaves it running)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Healthz(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = b"success" if self.path == "/-/healthz" else b"not found"
            self.send_response(200 if self.path == "/-/healthz" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def test_serve_run_beside_another_ray_instances_serve_says_so_in_one_line(serve_like_port):
    """A Serve of another Ray instance on the port: this command would start its own Ray instance, whose proxy
    could never bind the port (the app would wait with no error), so it stops at once and says why."""
    # no RAY_ADDRESS, and a Ray temp dir of its own: no `ray start` cluster for ray.init() to connect to
    env = {**{k: v for k, v in ENV.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray-")}
    p = subprocess.run([sys.executable, "-c", SERVE_RUN.format(port=serve_like_port, target="deployments.app:app",
                                                                args=[])],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert p.returncode == 1, (p.stdout, p.stderr)
    [line] = _error_lines(p.stderr)
    assert "another Ray Serve instance" in line and "Ctrl-C" in line and "--port" in line
    assert "Started a local Ray instance" not in p.stderr + p.stdout


@pytest.mark.parametrize("how", ["serve run", "persistent-serve"])
def test_a_model_that_is_not_there_is_one_line_before_ray_starts(how, tmp_path):
    missing = str(tmp_path / "nonexistent.gguf")
    if how == "serve run":
        p = _run(SERVE_RUN.format(port=_free_port(), target="deployments.app:build_app", args=[f"model={missing}"]))
    else:
        p = _run(["-m", "deployments.cli", "--model", missing, "--port", str(_free_port())])
    assert p.returncode == 2, (p.stdout, p.stderr)
    [line] = [ln for ln in p.stderr.splitlines() if "is not an embedded alias" in ln]
    assert line.startswith(f"{how}: model {missing!r}") and "Traceback" not in p.stderr
    assert "Started a local Ray instance" not in p.stderr + p.stdout


def test_persistent_serve_on_a_taken_port_says_so_in_one_line(taken_port):
    p = _run(["-m", "deployments.cli", "--port", str(taken_port)])
    assert p.returncode == 1, (p.stdout, p.stderr)
    [line] = _error_lines(p.stderr)
    assert line.startswith("persistent-serve: cannot serve HTTP") and "--port" in line and "Traceback" not in p.stderr


DEDUP = """
import sys
import ray.serve._private.constants as c
c.DEFAULT_HTTP_PORT = {port}
sys.argv = ["serve", "run", "deployments.app:build_app"]
from deployments.app import build_app
build_app({{"tracing_exporter": {exporter!r}}})
from ray._private.ray_logging import stdout_deduplicator as d
span = '{{"name": "route", "kind": "SpanKind.INTERNAL", "attributes": {{"lane": "persistent"}}}}'
out = [b for pid in (11, 12, 13) for b in d.deduplicate({{"ip": "10.0.0.1", "pid": pid, "lines": [span]}})]
print("printed", sum(len(b["lines"]) for b in out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_console_tracing_keeps_every_span_line_under_serve_run():
    """The same span line from three replicas: Ray's driver prints it once ("[repeated 2x across cluster]" later),
    unless the app's exporter is console, in which case every one is printed."""
    console = _run(DEDUP.format(port=_free_port(), exporter="console"))
    assert "printed 3" in console.stdout, (console.stdout, console.stderr)
    none = _run(DEDUP.format(port=_free_port(), exporter="none"))
    assert "printed 1" in none.stdout, (none.stdout, none.stderr)
