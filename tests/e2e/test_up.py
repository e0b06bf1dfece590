"""The real `llmgw up` as a subprocess: serve a request through it, query the ledger, stop it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.procs import REPO, Followed


def _children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_llmgw_up_serves_a_request_records_usage_and_stops_everything(tiny_model: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    stack = Followed([sys.executable, "-m", "services.cli", "up", "--model", str(tiny_model), "--model-id",
                      "tiny", "--port", "0", "--data-dir", str(data)], marker="llmgw is up.", env=env,
                     own_group=True)
    proc = stack.proc
    try:
        url = stack.wait_ready(120).split("Gateway: ", 1)[1].split()[0]
        children = _children_of(proc.pid)
        assert len(children) >= 5  # nats-server, accounting, telemetry, engine, gateway
        key = stack.line_with("API key: ").split("API key: ", 1)[1].split()[0]
        assert key.startswith("sk-")

        anonymous = openai.OpenAI(base_url=url + "/v1", api_key="not-a-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):  # loopback is not trusted by default
            anonymous.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=8)
        assert reply.choices[0].finish_reason in ("stop", "length")
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True)
            if c.choices
        )
        assert isinstance(text, str)
        # issue #25: embeddings on the default stack come from our engine (they were a 503 "retry shortly")
        vectors = client.embeddings.create(model="tiny", input=["hi", "there"])
        assert [len(d.embedding) for d in vectors.data] == [64, 64] and vectors.usage.prompt_tokens > 0

        cli = [sys.executable, "-m", "services.cli", "sql", "--data-dir", str(data), "--format", "csv"]
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run([*cli, "select count(*) as n from requests"], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=60)
            if out.returncode == 0 and out.stdout.splitlines()[1:] == ["3"]:
                break
            assert time.monotonic() < deadline, out.stdout + out.stderr
            time.sleep(0.2)
        refused = subprocess.run([*cli, "delete from requests"], cwd=REPO, env=env, capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode != 0 and "only read-only SELECT" in refused.stderr
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group gets it
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    stack.reader.join(5)
    assert proc.returncode == 0, stack.output[-3000:]
    assert "Traceback" not in stack.output, stack.output[-3000:]  # every service stops cleanly
    # the banner showed the first start's credentials: a Ctrl-C after it does not claim the stack never came up
    assert "did not come up" not in stack.output, stack.output[-3000:]
    leftovers = [pid for pid in children if _alive(pid)]
    assert leftovers == [], f"processes left running after Ctrl-C: {leftovers}"
    # After the stack stopped, the ledger is still queryable straight from the file.
    out = subprocess.run([*cli, "select model, status from requests order by ts"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["model,status", "tiny,ok", "tiny,ok", "tiny,ok"]
