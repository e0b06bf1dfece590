"""Pure: ``--discover host:port-port`` ranges, and the deterministic ids of what answers in them.

Telemetry probes each port of a range with ``GET /v1/models`` (service.py); a port that answers with an
OpenAI model list becomes a watched member ``disc-<host>-<port>``, offered on ``GET /members`` so an
operator can copy it into the pools file. The id depends only on the address, so a restarted telemetry
publishes under the same ids and gateways keep their history.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.common.runtime import ConfigError

MAX_PORTS_PER_RANGE = 1024  # a typo like 1-65535 must not turn telemetry into a port scanner
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


@dataclass(frozen=True)
class PortRange:
    host: str
    first_port: int
    last_port: int

    def ports(self) -> range:
        return range(self.first_port, self.last_port + 1)

    def url(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}"


def parse_range(spec: str) -> PortRange:
    """``host:port`` or ``host:first-last``; raises ConfigError naming ``discover``."""
    host, sep, ports = spec.strip().rpartition(":")
    host = host.strip("[]")
    first, dash, last = ports.partition("-")
    if not sep or not host or not first.isdigit() or (dash and not last.isdigit()):
        raise ConfigError("discover", f"{spec!r} must look like host:8000-8010 (or host:8000)")
    lo, hi = int(first), int(last) if dash else int(first)
    if not 1 <= lo <= hi <= 65535:
        raise ConfigError("discover", f"{spec!r}: ports must satisfy 1 <= first <= last <= 65535")
    if hi - lo + 1 > MAX_PORTS_PER_RANGE:
        raise ConfigError("discover", f"{spec!r}: at most {MAX_PORTS_PER_RANGE} ports per range")
    return PortRange(host, lo, hi)


def discovered_id(host: str, port: int) -> str:
    """``disc-<host>-<port>`` with every run of characters outside [A-Za-z0-9_-] made one '-'."""
    return _UNSAFE.sub("-", f"disc-{host}-{port}").strip("-")[:128]
