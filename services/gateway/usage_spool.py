"""A bounded on-disk spool for UsageRecords the bus could not take (NATS down, JetStream unavailable).

Records are appended length-prefixed to ``<dir>/usage.spool``. To resend, the spool file is renamed to
``usage.inflight`` and read back; it is deleted only after every record in it was acknowledged by the
stream. A crash in between re-sends the same records later, which the stream's duplicate window and the
ledger's request-id key both absorb: nothing is lost and nothing is counted twice.

The records name API keys, users and models: the directory is 0700 and the files 0600 (owner only),
created so and corrected at start when an older version left them readable (docs/deploy.md).
"""

from __future__ import annotations

import logging
import os
import stat
import struct
from pathlib import Path

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
_FILE_MODE = 0o600
_DIR_MODE = 0o700


def _make_private(path: Path, mode: int) -> None:
    try:
        if stat.S_IMODE(path.stat().st_mode) != mode:
            os.chmod(path, mode)
    except FileNotFoundError:
        pass


class UsageSpool:
    def __init__(self, directory: Path, max_bytes: int = 256 * 1024 * 1024) -> None:
        directory.mkdir(parents=True, exist_ok=True, mode=_DIR_MODE)
        self.spool = directory / "usage.spool"
        self.inflight = directory / "usage.inflight"
        _make_private(directory, _DIR_MODE)
        for path in (self.spool, self.inflight):
            _make_private(path, _FILE_MODE)
        self.max_bytes = max_bytes
        self.num_refused = 0

    def append(self, data: bytes) -> bool:
        """Spool one encoded record; False (and logged) when the spool is full."""
        size = self.spool.stat().st_size if self.spool.exists() else 0
        if size + len(data) + _LEN.size > self.max_bytes:
            self.num_refused += 1
            log.error("usage spool %s is full (%d bytes): a usage record could not be kept (%d so far)",
                      self.spool, size, self.num_refused)
            return False
        with os.fdopen(os.open(self.spool, os.O_WRONLY | os.O_APPEND | os.O_CREAT, _FILE_MODE), "ab") as f:
            f.write(_LEN.pack(len(data)) + data)
            f.flush()
            os.fsync(f.fileno())
        return True

    def has_pending(self) -> bool:
        return self.inflight.exists() or self.spool.exists()

    def take(self) -> list[bytes]:
        """The records to resend (the in-flight batch first); call :meth:`done` once all were sent."""
        if not self.inflight.exists():
            if not self.spool.exists():
                return []
            os.replace(self.spool, self.inflight)
        data = self.inflight.read_bytes()
        records, offset = [], 0
        while offset + _LEN.size <= len(data):
            (n,) = _LEN.unpack_from(data, offset)
            offset += _LEN.size
            if offset + n > len(data):  # a torn last write (crash mid-append): drop the fragment
                log.warning("usage spool ends in a partial record (%d bytes); skipped", len(data) - offset)
                break
            records.append(data[offset:offset + n])
            offset += n
        return records

    def done(self) -> None:
        self.inflight.unlink(missing_ok=True)
