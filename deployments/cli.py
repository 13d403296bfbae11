"""``persistent-serve`` command line: start the app on Ray Serve and block.

Example::

    persistent-serve --persistent-decoder auto --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import sys
import time

from pydantic import ValidationError

from deployments.config import AppConfig


def parse_args(argv: list[str] | None = None) -> dict:
    """Parse CLI flags into ``build_app`` arguments (only the flags that were given)."""
    p = argparse.ArgumentParser(
        prog="persistent-serve",
        description="Serve an OpenAI-compatible API on Ray Serve with persistent and standard lanes.",
    )
    p.add_argument("--model", help="smollm2-135m-instruct (embedded, default), a .gguf file, or an HF checkpoint dir")
    p.add_argument("--served-model-name", help="name clients send as `model` (default: --model)")
    p.add_argument("--persistent-decoder", choices=["off", "auto", "required"],
                   help="off: all standard; auto (default): eligible requests go persistent; "
                        "required: refuse to start without a working persistent decoder")
    p.add_argument("--persistent-decoder-checkpoint", metavar="DIR",
                   help="persistent-decoder checkpoint directory (manifest + safetensors)")
    p.add_argument("--persistent-backend", choices=["auto", "eager", "cuda_graph", "mk1"],
                   help="persistent backend (default auto; mk1 needs AMD aiter on an MI355X)")
    p.add_argument("--num-persistent-replicas", type=int, help="persistent-lane replicas (default 1)")
    p.add_argument("--num-standard-replicas", type=int, help="standard-lane replicas (default 1)")
    p.add_argument("--spillover-wait-s", type=float,
                   help="seconds an eligible request waits for a busy persistent pool before going standard "
                        "(default 0.5)")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype (auto: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output in tokens (default 2048)")
    p.add_argument("--num-kv-blocks", type=int, help="KV pages of 16 tokens per replica (default 4 x max-model-len)")
    p.add_argument("--tracing-exporter", choices=["console", "otlp", "none"],
                   help="OpenTelemetry exporter (default: $OTEL_TRACES_EXPORTER or none)")
    p.add_argument("--tracing-endpoint", help="OTLP endpoint (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")
    p.add_argument("--tracing-protocol", choices=["http/protobuf", "grpc"],
                   help="OTLP transport (default: $OTEL_EXPORTER_OTLP_PROTOCOL or http/protobuf)")
    p.add_argument("--tracing-service-name", help="service.name of every span (default: persistent-serve)")
    p.add_argument("--tracing-sample-ratio", type=float,
                   help="fraction of traces exported; fallback traces always are (default: $OTEL_TRACES_SAMPLER_ARG or 1)")
    p.add_argument("--api-key", nargs="+", action="extend", metavar="KEY",
                   help="require `Authorization: Bearer KEY` (one or more keys; visible in `ps`: prefer "
                        "$PERSISTENT_SERVE_API_KEY)")
    p.add_argument("--admin-api-key", nargs="+", action="extend", metavar="KEY",
                   help="keys for /debug/... (default: loopback clients only; prefer $PERSISTENT_SERVE_ADMIN_API_KEY)")
    p.add_argument("--allow-special-tokens", action="store_true", default=None,
                   help="parse special-token strings in client text as special tokens (vLLM's behaviour; "
                        "default: tokenize them as text)")
    p.add_argument("--max-request-body-bytes", type=int, help="largest request body (default 4 MiB; 413 above)")
    p.add_argument("--request-body-timeout-s", type=float,
                   help="seconds the whole body may take to arrive (default 30; 408)")
    p.add_argument("--request-idle-timeout-s", type=float,
                   help="longest gap between body chunks in seconds (default 10; 408)")
    p.add_argument("--max-prompt-chars", type=int,
                   help="most prompt characters, checked before tokenizing (default 32 x max-model-len)")
    p.add_argument("--max-messages", type=int, help="most messages per chat request (default 2048)")
    p.add_argument("--max-output-tokens", type=int, help="most output tokens per request (default: what fits the context)")
    p.add_argument("--keep-alive-timeout-s", type=int,
                   help="close idle keep-alive HTTP connections after this many seconds (Serve's "
                        "http_options.keep_alive_timeout_s; default 90)")
    p.add_argument("--metrics-export-port", type=int,
                   help="start Ray with its Prometheus endpoint on this port (http://HOST:PORT/metrics)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    ns = vars(p.parse_args(argv))
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
    import ray
    from ray import serve

    from deployments.app import build_app

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
