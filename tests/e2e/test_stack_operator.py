"""`llmgw up` run as a careless operator would (issue #25): twice, with its NATS killed, with a wrong --model;
and the banner's curl line run by a real shell."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.cli.stack import _banner
from tests.e2e.procs import REPO, Followed, stop_stack

MODEL_ID = "tiny"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "NINFER_API_KEY")}


def _up(model: Path, data: Path) -> list[str]:
    return [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--model-id", MODEL_ID,
            "--port", "0", "--data-dir", str(data)]


@pytest.fixture(scope="module")
def running(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Followed, Path, str, str]]:
    data = tmp_path_factory.mktemp("operator") / "data"
    followed = Followed(_up(tiny_model, data), marker="llmgw is up.", env=_env(), own_group=True)
    try:
        line = followed.wait_ready(180)
        url = line.split("Gateway: ", 1)[1].split()[0]
        key = followed.line_with("API key: ").split("API key: ", 1)[1].split()[0]
        yield followed, data, url, key
    finally:
        stop_stack(followed)


def _chat(url: str, key: str) -> str | None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10)
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4).choices[0].finish_reason


@pytest.mark.slow
def test_a_second_llmgw_up_on_the_same_data_dir_says_so_in_one_line(
        running: tuple[Followed, Path, str, str], tiny_model: Path) -> None:
    followed, data, url, _ = running
    second = subprocess.run(_up(tiny_model, data), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert second.returncode != 0
    lines = (second.stdout + second.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "already runs" in lines[0] and f"pid {followed.proc.pid}" in lines[0]
    assert url in lines[0] and str(data) in lines[0]
    # and no second nats-server was started on the JetStream directory
    servers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).count(str(data / "nats"))]
    assert len(servers) == 1, [_cmdline(p) for p in servers]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
def test_the_supervisor_restarts_a_nats_server_that_died(running: tuple[Followed, Path, str, str]) -> None:
    followed, data, url, key = running
    assert _chat(url, key) in ("stop", "length")
    (server,) = [p for p in Path("/proc").iterdir()
                 if p.name.isdigit() and "nats-server" in _cmdline(p) and str(data / "nats") in _cmdline(p)]
    os.kill(int(server.name), signal.SIGKILL)
    followed.line_with("nats-server exited (code -9); restarting it", timeout_s=20)
    deadline = time.monotonic() + 60
    while True:  # the services reconnect to the same port and the engine's heartbeat returns
        try:
            if _chat(url, key) in ("stop", "length"):
                break
        except openai.APIError:
            pass
        assert time.monotonic() < deadline, followed.output[-3000:]
        time.sleep(0.5)
    assert followed.proc.poll() is None


@pytest.mark.slow
def test_a_failed_first_start_still_shows_the_admin_password_and_key(tmp_path: Path) -> None:
    data = tmp_path / "data"
    out = subprocess.run(_up(tmp_path / "no-such-model", data), cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=180)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "exited during start-up" in text
    password = text.split("user admin  password ", 1)[1].split()[0]
    key = text.split("API key: ", 1)[1].split()[0]
    assert key.startswith("sk-") and len(password) >= 10
    # they are the real ones: the identity file holds that key
    from services.gateway.identity import IdentityStore, key_digest

    store = IdentityStore(data / "identity")
    try:
        assert store.has_users()
        assert key_digest(key) in {row["key_sha256"] for table, row in store.replica_rows() if table == "api_keys"}
    finally:
        store.close()


def test_the_banners_curl_line_lets_the_shell_expand_the_api_key(tmp_path: Path) -> None:
    banner = _banner("http://127.0.0.1:8080", "http://127.0.0.1:8081", "demo", "nats://127.0.0.1:4222", tmp_path,
                     None)
    lines = banner.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("curl "))
    command = "\n".join(lines[start:start + 3])
    # a shell whose curl prints its arguments: what would really be sent
    shown = subprocess.run(["bash", "-c", 'curl() { printf "%s\\n" "$@"; }\n' + command],
                           env={"LLMGW_API_KEY": "sk-from-the-shell", "PATH": os.environ["PATH"]},
                           capture_output=True, text=True, timeout=10)
    assert shown.returncode == 0, shown.stderr
    assert "Authorization: Bearer sk-from-the-shell" in shown.stdout.splitlines()
