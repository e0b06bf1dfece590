"""The real `ninfer convert` and `ninfer-serve` commands as a user runs them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.e2e.procs import REPO, Followed

RUNBOOK_FLAGS = ["--host", "127.0.0.1", "--port", "0", "--model-id", "qwen3.8-27b", "--max-context", "2048",
                 "--kv-dtype", "fp8", "--max-concurrency", "8", "--max-pending-requests", "64",
                 "--preserve-thinking", "--electricity-rate", "0.125"]


def test_convert_then_serve_the_single_file_artifact_with_the_runbook_flags(tiny_model: Path,
                                                                           tmp_path: Path) -> None:
    artifact = tmp_path / "tiny.ninfer"
    out = subprocess.run([sys.executable, "-m", "services.engine.model.artifact", "convert", str(tiny_model),
                          str(artifact)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    state = tmp_path / "metrics-state.json"
    served = Followed([sys.executable, "-m", "services.engine", str(artifact), *RUNBOOK_FLAGS, "--metrics-state",
                       str(state), "--data-dir", str(tmp_path / "data")], marker="llmgw engine ready:")
    proc = served.proc
    try:
        url = served.wait_ready(240).split("listening on ")[1].split()[0]  # start-up: a first kernel build
        log = served.output
        assert "free RAM" in log and "KV capacity" in log and "lanes 8" in log and "queue 64" in log
        with urllib.request.urlopen(url + "/v1/models") as r:
            card = json.load(r)["data"][0]
        assert card["id"] == "qwen3.8-27b" and card["max_model_len"] == 2048
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"model": "qwen3.8-27b", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            assert json.load(r)["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, served.output[-2000:]
    assert json.loads(state.read_text())["persisted_output_tokens"] == 3  # written at shutdown


def test_speculative_flags_fail_at_start_with_a_clear_message(tiny_model: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "services.engine", str(tiny_model), "--spec", "mtp",
                          "--draft-tokens", "4", "--lm-head-draft"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "speculative decoding" in out.stderr and "Traceback" not in out.stderr
