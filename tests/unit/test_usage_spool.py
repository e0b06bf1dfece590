from pathlib import Path

from services.gateway.usage_spool import UsageSpool


def test_spooled_records_come_back_in_order_and_stay_until_done(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    for i in range(3):
        assert spool.append(f"record-{i}".encode())
    assert spool.take() == [b"record-0", b"record-1", b"record-2"]
    spool.append(b"record-3")  # arrives while the batch is in flight
    assert spool.take() == [b"record-0", b"record-1", b"record-2"]  # not acknowledged yet: sent again
    spool.done()
    assert spool.take() == [b"record-3"]
    spool.done()
    assert not spool.has_pending()


def test_a_torn_last_write_is_skipped_and_a_full_spool_refuses_loudly(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path, max_bytes=64)
    spool.append(b"whole")
    with open(spool.spool, "ab") as f:
        f.write(b"\x00\x00\x00\x10part")  # a crash in the middle of an append
    assert spool.take() == [b"whole"]
    spool.done()
    assert spool.append(b"x" * 40)
    assert not spool.append(b"y" * 40)  # 4 + 40 + 4 + 40 > 64 bytes
    assert spool.num_refused == 1
