"""Run a real command and follow its output: the e2e tests' one way to start a service."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Followed:
    """A subprocess whose combined output is collected line by line on a thread."""

    def __init__(self, argv: Sequence[str], marker: str, env: dict[str, str] | None = None,
                 own_group: bool = False) -> None:
        """``own_group``: the process leads a process group of its own, like a job in a terminal, so
        ``os.killpg(proc.pid, SIGINT)`` is what Ctrl-C does there."""
        self.marker = marker
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.changed = threading.Condition()
        self.proc = subprocess.Popen(list(argv), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=own_group)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
            if self.marker in line:
                self.ready.set()

    def wait_ready(self, timeout_s: float) -> str:
        """The line carrying the marker; fails the test with the output's tail when it never comes."""
        assert self.ready.wait(timeout_s), f"no {self.marker!r} within {timeout_s}s:\n" + "".join(self.lines[-40:])
        return next(line for line in self.lines if self.marker in line)

    def line_with(self, text: str, timeout_s: float = 10.0) -> str:
        """The first output line containing ``text``, waiting for it to be printed."""
        with self.changed:
            found = self.changed.wait_for(lambda: next((ln for ln in self.lines if text in ln), None), timeout_s)
        assert found, f"no line with {text!r} within {timeout_s}s:\n" + "".join(self.lines[-40:])
        return found

    @property
    def output(self) -> str:
        return "".join(self.lines)


def stop_stack(followed: Followed) -> None:
    """Ctrl-C the whole ``llmgw up`` process group; kill it if it does not stop within 60 s."""
    os.killpg(followed.proc.pid, signal.SIGINT)
    try:
        followed.proc.wait(60)
    except subprocess.TimeoutExpired:
        followed.proc.kill()
        raise
