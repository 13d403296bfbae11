"""``persistent-serve`` command line: start the app on Ray Serve and block.

Every field of the app config (:class:`deployments.config.AppConfig`), of its engine settings
(:class:`replicas.config.EngineConfig`), of its tracing settings
(:class:`ops.telemetry.tracing.TracingConfig`, flags ``--tracing-*``) and of its API keys and request
limits (:class:`deployments.security.SecurityConfig`, :class:`deployments.security.RequestLimits`;
``--api-key K1 K2``) is a flag, with the field's description as its help and its allowed values as the choices: the config is the one source. Only the
flags given are passed on, so the config's defaults apply to the rest. Booleans take ``--flag`` /
``--no-flag``; dicts, lists and pool settings take JSON (``--moe-tiles '{"down_pairs": 1}'``).

Example::

    persistent-serve --persistent-decoder auto --model smollm2-135m-instruct --no-pipeline-quanta
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import time
import types
import typing

from pydantic import BaseModel, SecretStr, ValidationError

from deployments.config import AppConfig
from deployments.security import RequestLimits, SecurityConfig
from ops.telemetry.tracing import TracingConfig
from replicas.config import EngineConfig
from replicas.registry import OneOf

SKIPPED = ("engine", "tracing", "security", "limits", "persistent_fault_injection")
"""App config fields that are not flags: the nested groups (their fields are flags themselves) and the
tests-only fault injection."""


def _unwrap(annotation):
    """``X | None`` → ``X``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _default_text(field) -> str | None:
    """How ``--help`` shows a field's default: JSON for dicts, lists and nested settings, the value
    itself otherwise, ``unset`` for None, a SecretStr list as ``none``; None when the field is required."""
    if field.is_required():
        return None
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list | tuple):
        if value and isinstance(next(iter(value)), SecretStr):
            return "none"
        return json.dumps(value, default=str) if value else ("{}" if isinstance(value, dict) else "none")
    return str(value)


def _help(field) -> str:
    """The field's description and its default (argparse's ``%`` formatting escaped)."""
    text = (field.description or "").replace("%", "%%")
    default = _default_text(field)
    if default is not None:
        text = f"{text} (default: {default.replace('%', '%%')})".strip()
    return text


def _add_fields(parser: argparse.ArgumentParser, model: type[BaseModel], prefix: str = "",
                skip: tuple[str, ...] = ()) -> None:
    """One flag per field of ``model`` (``--{prefix}{name}`` in kebab case, ``dest`` ``{prefix}{name}``)."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        dest = prefix + name
        kwargs: dict = {"dest": dest, "help": _help(field), "default": None}
        ann = _unwrap(field.annotation)
        one_of = next((m for m in field.metadata if isinstance(m, OneOf)), None)
        if typing.get_args(ann)[:1] == (SecretStr,):  # API keys: --api-key K1 K2 (repeatable)
            kwargs.update(nargs="+", action="extend", metavar="KEY", type=str)
        elif one_of is not None:  # a registry's names (MoE backends, persistent backends)
            kwargs["choices"] = list(one_of.choices())
        elif typing.get_origin(ann) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(ann))
        elif isinstance(ann, type) and issubclass(ann, enum.Enum):
            kwargs["choices"] = [m.value for m in ann]
        elif ann is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif ann in (int, float, str):
            kwargs["type"] = ann
        else:  # dicts, tuples, nested models: JSON
            kwargs["type"] = json.loads
            kwargs["metavar"] = "JSON"
        parser.add_argument("--" + dest.replace("_", "-"), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser: the config's fields, plus ``--host``, ``--port``, ``--keep-alive-timeout-s`` (Serve's
    HTTP options) and ``--metrics-export-port``."""
    p = argparse.ArgumentParser(
        prog="persistent-serve",
        description="Serve an OpenAI-compatible API on Ray Serve with persistent and standard lanes.",
    )
    _add_fields(p, AppConfig, skip=SKIPPED)
    _add_fields(p, EngineConfig)
    _add_fields(p, TracingConfig, prefix="tracing_")
    _add_fields(p, SecurityConfig)
    _add_fields(p, RequestLimits)
    p.add_argument("--keep-alive-timeout-s", type=int,
                   help="close idle keep-alive HTTP connections after this many seconds (Serve's "
                        "http_options.keep_alive_timeout_s; default 90)")
    p.add_argument("--metrics-export-port", type=int,
                   help="start Ray with its Prometheus endpoint on this port (http://HOST:PORT/metrics; default: Ray's own, none fixed)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    return p


def parse_args(argv: list[str] | None = None) -> dict:
    """Parse CLI flags into ``build_app`` arguments (only the flags that were given)."""
    ns = vars(build_parser().parse_args(argv))
    return {k: v for k, v in ns.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    host, port = args.pop("host"), args.pop("port")
    http_options = {"host": host, "port": port}
    if "keep_alive_timeout_s" in args:
        http_options["keep_alive_timeout_s"] = args.pop("keep_alive_timeout_s")
    metrics_port = args.pop("metrics_export_port", None)
    try:
        config = AppConfig.from_args(args)
    except ValidationError as exc:
        print(f"persistent-serve: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    from deployments.driver import keep_span_lines_whole, local_model_problem, port_problem

    problem = local_model_problem(config.engine.model)
    if problem:
        print(f"persistent-serve: {problem}", file=sys.stderr)
        return 2
    problem = port_problem(host, port, "choose another port with --port (e.g. --port 8001)")
    if problem:
        print(f"persistent-serve: {problem}", file=sys.stderr)
        return 1
    import ray
    from ray import serve

    from deployments.app import build_app, console_tracing

    if console_tracing(config):
        keep_span_lines_whole()  # Ray's log deduplication would cut the printed spans
    if metrics_port is not None:
        ray.init(_metrics_export_port=metrics_port)

    serve.start(http_options=http_options)
    serve.run(build_app(config), blocking=False)
    print(f"persistent-serve: serving {config.engine.name} on http://{host}:{port}/v1", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
