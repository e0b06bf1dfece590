"""The pure parts of ``llmgw gateway --workers``: the merged /metrics answer (worker_metrics.py), the restart
back-off (workers.py) and each worker's own limit counters in the shared identity.db (identity.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services.common.prom import PromText
from services.gateway import worker_metrics
from services.gateway.identity import IdentityStore
from services.gateway.workers import bind_listener, restart_delay_s


def _text(requests: int, latency_s: float) -> str:
    m = PromText()
    m.counter("llmgw_requests_total", "Requests.", requests, {"pool": "p", "status": "ok"})
    m.gauge("llmgw_up", "Up.", 1, {})
    return m.render()


def test_a_sample_gets_the_worker_label_first_with_or_without_labels() -> None:
    assert worker_metrics.with_label('a_total{pool="p"} 3', "worker", "w1") == 'a_total{worker="w1",pool="p"} 3'
    assert worker_metrics.with_label("a_total 3", "worker", "w1") == 'a_total{worker="w1"} 3'
    assert worker_metrics.with_label("a_total{} 3", "worker", "w1") == 'a_total{worker="w1"} 3'


def test_the_merged_answer_holds_every_workers_samples_once_per_family_and_says_how_many_reported() -> None:
    merged = worker_metrics.merge({"w1": _text(5, 0.2), "w0": _text(7, 0.1)}, num_workers=3)
    lines = merged.splitlines()
    assert "llmgw_gateway_workers 3" in lines and "llmgw_gateway_workers_reporting 2" in lines
    assert lines.count("# TYPE llmgw_requests_total counter") == 1  # a family's samples stay together
    start = lines.index("# TYPE llmgw_requests_total counter")
    assert lines[start + 1:start + 3] == ['llmgw_requests_total{worker="w0",pool="p",status="ok"} 7',
                                          'llmgw_requests_total{worker="w1",pool="p",status="ok"} 5']
    # sum without (worker): 7 + 5 requests, what the whole gateway served
    total = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("llmgw_requests_total{"))
    assert total == 7 + 5
    assert [ln for ln in lines if ln.startswith("llmgw_up")] == ['llmgw_up{worker="w0"} 1', 'llmgw_up{worker="w1"} 1']


def test_a_worker_that_keeps_exiting_is_restarted_later_each_time_up_to_a_cap() -> None:
    assert [restart_delay_s(n) for n in (0, 1, 2, 3, 4)] == [0.5, 0.5, 1.0, 2.0, 4.0]
    assert restart_delay_s(20) == 30.0


def test_each_worker_keeps_its_own_limit_counters_in_the_shared_identity_db(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path / "identity")
    other = IdentityStore(tmp_path / "identity")  # a second process on the same file
    try:
        store.save_limit_usage({"key-k|tokens_per_day|20424": 300.0}, "")  # a gateway of one process, before
        store.save_limit_usage({"key-k|tokens_per_day|20424": 100.0 + 300.0}, "w0")  # w0 took those 300 over
        other.save_limit_usage({"key-k|tokens_per_day|20424": 50.0}, "w1")
        other.save_limit_usage({"key-k|tokens_per_day|20424": 60.0}, "w1")  # w1's save replaces w1's rows only
        assert store.load_limit_usage("w0") == {"key-k|tokens_per_day|20424": 400.0}
        assert store.load_limit_usage("w1") == {"key-k|tokens_per_day|20424": 60.0}
        # back to one process: it counts every worker's requests
        assert store.load_limit_usage("") == {"key-k|tokens_per_day|20424": 400.0 + 60.0}
    finally:
        store.close()
        other.close()


def test_a_first_worker_takes_over_what_a_single_gateway_saved(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path / "identity")
    try:
        store.save_limit_usage({"user-u|usd_per_month|2026-12": 2.5}, "")
        assert store.load_limit_usage("w0") == {"user-u|usd_per_month|2026-12": 2.5}
        assert store.load_limit_usage("w1") == {}
    finally:
        store.close()


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="SO_REUSEPORT is what this test checks")
def test_with_so_reuseport_the_parent_holds_the_port_and_workers_listen_on_it() -> None:
    held, reuse_port = bind_listener("127.0.0.1", 0)
    try:
        assert reuse_port
        port = held.getsockname()[1]
        workers = []
        for _ in range(2):  # what each worker's aiohttp site does with reuse_port=True
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
            workers.append(s)
        with socket.create_connection(("127.0.0.1", port), timeout=60):
            pass
        for s in workers:
            s.close()
    finally:
        held.close()


def test_without_so_reuseport_the_parent_listens_and_hands_the_socket_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(socket, "SO_REUSEPORT", raising=False)
    sock, reuse_port = bind_listener("127.0.0.1", 0)
    try:
        assert not reuse_port and sock.get_inheritable()
        with socket.create_connection(sock.getsockname()[:2], timeout=60):  # it listens: the kernel queues us
            pass
    finally:
        sock.close()


def test_each_worker_keeps_its_own_routing_tables_and_first_starts_from_the_single_process(tmp_path: Path) -> None:
    from services.gateway.routing_adapter import Router

    now = 1_000_000.0
    single = Router(tmp_path, now)
    single.pins.pin("session-a", "m1", now)
    single.save(now)
    w1 = Router(tmp_path, now + 1, worker="w1")
    assert w1.pins.get("session-a", now + 1) == "m1"  # its first start: what the single process learnt
    w1.pins.pin("session-b", "m2", now + 1)
    w1.save(now + 1)
    w0 = Router(tmp_path, now + 2, worker="w0")
    w0.pins.unpin("session-a")
    w0.save(now + 2)
    # one file per worker: w0's save did not overwrite what w1 learnt, nor the single process's
    assert Router(tmp_path, now + 3, worker="w1").pins.get("session-b", now + 3) == "m2"
    assert Router(tmp_path, now + 3, worker="w0").pins.get("session-a", now + 3) is None
    assert Router(tmp_path, now + 3).pins.get("session-a", now + 3) == "m1"
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "routing").rglob("pins.json")) == [
        "routing/pins.json", "routing/w0/pins.json", "routing/w1/pins.json"]


def test_a_key_a_sibling_worker_revoked_in_the_shared_file_stops_working_here_when_its_row_arrives(
        tmp_path: Path) -> None:
    """Two processes on one identity.db: the row that comes over the bus is the version the file already
    holds (the sibling wrote it), so it changes nothing there, but this process's in-memory copy must follow."""
    import time

    from services.gateway.identity import hash_password, key_digest

    here, sibling = IdentityStore(tmp_path / "identity"), IdentityStore(tmp_path / "identity")
    try:
        user = sibling.create_user("bob", hash_password("bob-password-1"), "user")
        here.refresh()
        key, record = sibling.create_key(user.user_id, "laptop", None, time.time())
        row = sibling.replica_row("api_keys", record.key_id)
        assert row is not None
        assert here.apply_replica("api_keys", row) is False  # the file had it already ...
        assert here.lookup_key(key_digest(key), time.time()) is not None  # ... and here it works at once
        sibling.revoke_key(record.key_id, time.time())
        row = sibling.replica_row("api_keys", record.key_id)
        assert row is not None
        here.apply_replica("api_keys", row)
        assert here.lookup_key(key_digest(key), time.time()) is None  # revoked here too, not 15 s later
    finally:
        here.close()
        sibling.close()
