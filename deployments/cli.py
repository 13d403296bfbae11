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
    """Parse CLI flags into ``build_app`` arguments (only flags that were given)."""
    p = argparse.ArgumentParser(prog="persistent-serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="embedded alias, .gguf file or HF checkpoint directory")
    p.add_argument("--served-model-name")
    p.add_argument("--persistent-decoder", choices=["off", "auto", "required"])
    p.add_argument("--persistent-decoder-checkpoint", metavar="DIR")
    p.add_argument("--persistent-backend", choices=["auto", "eager"])
    p.add_argument("--num-persistent-replicas", type=int)
    p.add_argument("--num-standard-replicas", type=int)
    p.add_argument("--device")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--tracing-exporter", choices=["console", "otlp", "none"])
    p.add_argument("--tracing-endpoint")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    ns = vars(p.parse_args(argv))
    return {k: v for k, v in ns.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    host, port = args.pop("host"), args.pop("port")
    try:
        config = AppConfig.from_args(args)
    except ValidationError as exc:
        print(f"persistent-serve: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    from ray import serve

    from deployments.app import build_app

    serve.start(http_options={"host": host, "port": port})
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
