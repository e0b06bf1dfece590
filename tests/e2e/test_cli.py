import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_a_missing_model_directory_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    out = run_cli("engine", str(tmp_path / "no-such-model"), "--data-dir", str(tmp_path))
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert lines == [f"llmgw engine: cannot load model from {tmp_path / 'no-such-model'}: directory does not exist"]


def test_a_bad_flag_value_names_the_key(tmp_path: Path) -> None:
    out = run_cli("telemetry", "--member", "not-a-url", "--data-dir", str(tmp_path))
    assert out.returncode == 2
    assert "config member:" in out.stderr and "Traceback" not in out.stderr


def test_sql_without_a_ledger_says_what_to_do(tmp_path: Path) -> None:
    out = run_cli("sql", "select 1", "--data-dir", str(tmp_path))
    assert out.returncode == 1
    assert "make up" in out.stderr
