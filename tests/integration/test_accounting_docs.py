"""Every example query in docs/accounting.md runs, and the per-key one counts each key's energy once.

The queries are parsed out of the doc's ```sql blocks, so the doc and this test cannot drift apart. The
ledger has two workers in one pool: ``daily_usage`` then has a row per worker for a key that used both,
which a row-by-row join to the key's energy would count twice.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from proto import EnergySample, UsageRecord
from services.accounting.store import Ledger, PriceBookEntry
from tests.integration.test_accounting_energy import energy, utc_midnight

DOC = Path(__file__).resolve().parents[2] / "docs" / "accounting.md"
J_PER_KWH = 3.6e6
RATE = 0.125


def documented_queries() -> list[str]:
    blocks = re.findall(r"^```sql\n(.*?)^```", DOC.read_text(), flags=re.DOTALL | re.MULTILINE)
    return [statement.query.strip() for block in blocks for statement in duckdb.extract_statements(block)]


def usage(request_id: str, worker_id: str, api_key_id: str, ts_s: float, output_tokens: int) -> UsageRecord:
    return UsageRecord(gateway_id="gw", session_id="g", seq=0, ts_s=ts_s, request_id=request_id, model="m1",
                       pool="p", worker_id=worker_id, api_key_id=api_key_id, prompt_tokens=10,
                       output_tokens=output_tokens)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    """Pool p, model m1, on w1 and w2. w1: 1000 J over r1 (k1, 1 token) and r2 (k2, 1 token); w2: 600 J,
    all r3 (k1, 2 tokens)."""
    t0 = max(time.time() - 600, utc_midnight() + 1)
    ledger = Ledger(tmp_path / "l.duckdb")
    ledger.set_tariff(RATE, t0, "--electricity-rate")
    ledger.set_price_book({"*": PriceBookEntry(prompt_usd_per_m=1.0, cached_usd_per_m=0.0, output_usd_per_m=2.0)})
    ledger.insert_usage([usage("r1", "w1", "k1", t0 + 5, 1), usage("r2", "w1", "k2", t0 + 5, 1),
                         usage("r3", "w2", "k1", t0 + 5, 2)])
    samples: list[EnergySample] = [
        # each worker on a GPU of its own (one GPU's readings form one stream, whatever worker sends them)
        energy(1, t0, 0, worker="w1", device="GPU-1"),
        energy(2, t0 + 5, 1_000_000, worker="w1", device="GPU-1", tokens=(("r1", 1), ("r2", 1))),
        energy(1, t0, 0, worker="w2", device="GPU-2"),
        energy(2, t0 + 5, 600_000, worker="w2", device="GPU-2", tokens=(("r3", 2),))]
    ledger.insert_energy(samples)
    ledger.refresh_rollups(time.time(), retention_days=30)
    yield ledger
    ledger.close()


def test_the_doc_has_the_example_queries_the_issue_asks_for() -> None:
    titles = [q.splitlines()[0] for q in documented_queries()]
    assert any("today's kWh" in t for t in titles) and any("by API key" in t for t in titles)
    assert any("J per output token" in t for t in titles)


def test_every_documented_example_query_runs_and_the_per_key_one_counts_energy_once(ledger: Ledger) -> None:
    results = {}
    for query in documented_queries():
        columns, rows = ledger.query(query)
        results[query.splitlines()[0]] = [dict(zip(columns, row, strict=True)) for row in rows]
    (by_key,) = [rows for title, rows in results.items() if "by API key" in title]
    list_usd = lambda prompt, output: (prompt * 1.0 + output * 2.0) / 1e6  # noqa: E731
    assert {r["api_key_id"]: (r["requests"], r["output_tokens"], r["list_usd"], r["busy_kwh"], r["energy_usd"])
            for r in by_key} == {
        "k1": (2, 1 + 2, pytest.approx(list_usd(10, 1) + list_usd(10, 2)), pytest.approx((500 + 600) / J_PER_KWH),
               pytest.approx((500 + 600) / J_PER_KWH * RATE)),
        "k2": (1, 1, pytest.approx(list_usd(10, 1)), pytest.approx(500 / J_PER_KWH),
               pytest.approx(500 / J_PER_KWH * RATE)),
    }
    (by_model,) = [rows for title, rows in results.items() if "today's kWh" in title]
    assert by_model == [{"model_id": "m1", "kwh": pytest.approx((1000 + 600) / J_PER_KWH),
                         "usd": pytest.approx((1000 + 600) / J_PER_KWH * RATE), "coverage_pct": 100.0}]
