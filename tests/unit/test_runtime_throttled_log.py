"""ThrottledLog: one line per kind per period, then a count of what was held back."""

from __future__ import annotations

import logging

from services.common.runtime import ThrottledLog


def test_repeats_within_the_period_are_held_back_and_counted(caplog) -> None:  # type: ignore[no-untyped-def]
    now = [100.0]
    quiet = ThrottledLog(logging.getLogger("t"), every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        for i in range(50):
            quiet.warning("down", "member %s down (%d)", "e1", i)
            now[0] += 0.1
        quiet.warning("other", "another kind %d", 1)
        now[0] = 111.0
        quiet.warning("down", "member %s down (%d)", "e1", 99)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "member e1 down (0)"
    assert lines[1] == "another kind 1"
    assert lines[2] == "member e1 down (99) (and 49 more like it in the last 11 s)"
    assert len(lines) == 3


def test_buffered_log_lines_reach_stderr_at_exit_and_errors_at_once() -> None:
    """setup_logging buffers INFO lines (flushed within 50 ms or at exit) and writes errors at once."""
    import os
    import select
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import logging, sys\n"
        "from services.common.runtime import setup_logging\n"
        "setup_logging()\n"
        "logging.getLogger('t').info('info line')\n"
        "logging.getLogger('t').error('error line')\n"
        "sys.stdin.readline()\n"  # hold on until the test has seen the error line
        "logging.getLogger('t').info('last info line')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdin is not None and proc.stderr is not None
    try:
        seen = b""
        while b"error line" not in seen:  # while the child still runs, blocked on its stdin
            ready, _, _ = select.select([proc.stderr], [], [], 30)
            assert ready, f"no error line on stderr while the process runs: {seen!r}"
            seen += os.read(proc.stderr.fileno(), 65536)
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        seen += proc.stderr.read()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    lines = [line.split(": ", 1)[1] for line in seen.decode().splitlines() if line.strip()]
    assert lines == ["info line", "error line", "last info line"]


def test_hot_path_lines_read_exactly_like_logging_lines_and_go_through_logging_when_captured(caplog) -> None:  # type: ignore[no-untyped-def]
    """HotPathLog writes what the logging record would have become; a capture handler still sees a record."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from services.common.runtime import HotPathLog

    script = (
        "import logging, time\n"
        "from services.common.runtime import HotPathLog, setup_logging\n"
        "setup_logging()\n"
        "t = time.time()\n"
        "real = logging.Formatter(logging.getLogger().handlers[0].formatter._fmt)\n"
        "record = logging.LogRecord('llmgw.access', logging.INFO, '', 0, 'request_id=r1 ms=%s', ('1.5',), None)\n"
        "record.created, record.msecs = t, int((t - int(t)) * 1000) + 0.0\n"
        "print(real.format(record), flush=True)\n"
        "fmt = logging.getLogger().handlers[0].formatter\n"
        "print(fmt.info_line('llmgw.access', 'request_id=r1 ms=1.5', t), end='')\n"
        "logging.getLogger().handlers[0].write_info_line('llmgw.access', 'request_id=r1 ms=1.5')\n"
        "HotPathLog('llmgw.access').info('second line')\n"
        "logging.getLogger('llmgw').setLevel(logging.WARNING)\n"
        "HotPathLog('llmgw.access').info('not written: below the level')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2], env=dict(os.environ, LLMGW_LOG_LEVEL="INFO"))
    assert out.returncode == 0, out.stderr
    by_logging, by_hot_path = out.stdout.splitlines()
    assert by_hot_path == by_logging  # the same text, to the millisecond, for the same moment
    written = out.stderr.splitlines()
    assert len(written) == 2
    assert written[0][:19] == by_logging[:19] or written[0][:17] == by_logging[:17]  # made within the same second
    assert written[0][23:] == by_logging[23:] == " INFO llmgw.access: request_id=r1 ms=1.5"
    assert written[1].endswith(" INFO llmgw.access: second line")

    with caplog.at_level(logging.INFO, logger="llmgw.access"):  # a capture handler: an ordinary record
        HotPathLog("llmgw.access").info("request_id=r2")
    assert [r.getMessage() for r in caplog.records] == ["request_id=r2"]
