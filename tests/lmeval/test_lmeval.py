"""EleutherAI's lm-eval (0.4.13) against the app, as a user runs it: its real client code over real HTTP.

CI stage ``make test-lmeval`` (marker ``lmeval``; needs the ``lmeval`` extra). One app on a local
Ray cluster (the embedded SmolLM2, auto mode, a 2,048-token context for 3-shot GSM8K), then:

* GSM8K (``tasks/gsm8k_local.yaml``: lm-eval's gsm8k prompt, stop strings and filters, on the
  committed 4-problem sample) through ``local-chat-completions``: every request carries
  lm-eval's stop strings and is greedy, so every one must be served by the persistent lane
  (``/debug/stats`` counts what each lane served);
* the same through ``local-completions``, which first asks ``GET /tokenizer_info`` (its remote
  tokenizer: no tokenizer download) and sends token ids as ``prompt: [[ids]]``;
* a multiple-choice (loglikelihood) task through ``local-completions`` with ``echo`` and
  ``logprobs``, batched (several prompts per request).

Each run must finish with no HTTP error (lm-eval logs every failed request it retries).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.lmeval, pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]
TASKS = Path(__file__).resolve().parent / "tasks"
MODEL = "smollm2-135m-instruct"
LIMIT = 3
"""GSM8K problems per run (of the 4 committed)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app() -> str:
    pytest.importorskip("lm_eval")
    ray = pytest.importorskip("ray")
    from ray import serve

    from deployments.app import build_app

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"max_model_len": 2048, "num_kv_blocks": 256, "persistent_decoder": "auto",
                         # lm-eval's remote tokenizer reads eos_token_id as /tokenize(eos_token)[0]
                         "allow_special_tokens": True, "progress": False}), name="lmeval", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    yield base
    serve.shutdown()
    ray.shutdown()


def _served(base: str) -> dict[str, int]:
    return httpx.get(f"{base}/debug/stats", timeout=30).json()["router"]["served"]


def lm_eval(model: str, model_args: dict, tasks: str, out: Path, *extra: str) -> dict:
    """Run ``lm-eval run`` in a subprocess from the repository root (the task files' data paths are relative to
    it), offline; return its results JSON. Fails on a non-zero exit or any failed HTTP request."""
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", args, "--tasks", tasks,
           "--include_path", str(TASKS), "--output_path", str(out), "--log_samples", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out / "hf"),
           "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": "unused"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "API request failed" not in log and "Retrying" not in log, log[-6000:]
    (results,) = list(out.rglob("results_*.json"))
    return json.loads(results.read_text())


def _samples(out: Path, task: str) -> list[dict]:
    """The logged samples of ``task``, one per document (lm-eval logs one per answer filter)."""
    (path,) = list(out.rglob(f"samples_{task}_*.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return list({r["doc_id"]: r for r in rows}.values())


def test_gsm8k_chat_completions_is_served_by_the_persistent_lane(app, tmp_path):
    before = _served(app)
    results = lm_eval("local-chat-completions",
                      {"base_url": f"{app}/v1/chat/completions", "model": MODEL, "num_concurrent": 1,
                       "max_retries": 1, "timeout": 600},
                      "gsm8k_local", tmp_path, "--apply_chat_template", "--limit", str(LIMIT))
    after = _served(app)
    assert "exact_match,strict-match" in results["results"]["gsm8k_local"]
    samples = _samples(tmp_path, "gsm8k_local")
    assert len(samples) == LIMIT and all(s["resps"][0][0].strip() for s in samples)
    # lm-eval's stop strings ("Question:", "</s>", "<|im_end|>") ride on every request, all greedy: persistent
    assert after["persistent"] - before["persistent"] == LIMIT, (before, after)
    assert after["standard"] == before["standard"], (before, after)


def test_gsm8k_completions_with_the_remote_tokenizer(app, tmp_path):
    before = _served(app)
    results = lm_eval("local-completions",
                      {"base_url": f"{app}/v1/completions", "model": MODEL, "num_concurrent": 1,
                       "max_retries": 1, "timeout": 600, "tokenizer_backend": "auto"},
                      "gsm8k_local", tmp_path, "--limit", str(LIMIT))
    assert "exact_match,flexible-extract" in results["results"]["gsm8k_local"]
    samples = _samples(tmp_path, "gsm8k_local")
    assert len(samples) == LIMIT and any(s["resps"][0][0].strip() for s in samples)  # (an answer may be empty)
    assert _served(app)["persistent"] - before["persistent"] == LIMIT


def test_multiple_choice_loglikelihood_through_echo_and_logprobs(app, tmp_path):
    before = _served(app)
    results = lm_eval("local-completions",
                      {"base_url": f"{app}/v1/completions", "model": MODEL, "num_concurrent": 1,
                       "max_retries": 1, "timeout": 600},
                      "choices_local", tmp_path, "--batch_size", "4")  # 4 prompts per request
    acc = results["results"]["choices_local"]["acc,none"]
    samples = _samples(tmp_path, "choices_local")
    assert len(samples) == 6
    for s in samples:  # one (logprob, is_greedy) per answer, all finite and negative
        values = [float(r[0][0]) for r in s["resps"]]  # logged as text
        assert len(values) == 4 and all(v < 0 for v in values)
    assert acc >= 0.5, results["results"]  # a 135M model still knows most of these
    assert _served(app)["standard"] - before["standard"] == 24  # 6 questions x 4 answers, all with logprobs
