"""The pools file in force: loading it, reloading it when it changes, saving the Config page's edit, and
telling the other gateways and telemetry (``llm.v1.config.changed``) — and hearing from them.

A new file takes effect in one place (:meth:`PoolsFile._use_file_config`): the per-key concurrency limit
(auth) and the HTTP members' timeouts follow it; everything else reads :attr:`PoolsFile.file_config` when
it needs it. A broken file changes nothing and the log says why.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from proto import pools as pool_config
from proto import subjects
from services.common.runtime import ConfigError, atomic_write_text
from services.gateway.auth import Auth, Network, parse_networks
from services.gateway.http_backend import HttpBackend

log = logging.getLogger(__name__)


LAST_GOOD_NAME = "pools.last-good.json"  # in the data dir: the last pools file that loaded, for a broken restart


def initial_file_config(config_path: Path, given: pool_config.GatewayFileConfig | None, last_good_path: Path
                        ) -> tuple[pool_config.GatewayFileConfig, ConfigError | None]:
    """The pools file at start, and the problem with it if it is broken.

    The one given, else ``config_path`` when it exists (the file named on the command line, or DATA/pools.json,
    what the Config page saves when none was named). A broken file does not stop the gateway (issue #25: a
    corrupt pools.json crash-looped it and stopped the whole stack): it runs on the last file that loaded
    (``last_good_path``, kept at every successful load), else the defaults, says so in the log and on the
    Config page, and takes the file as soon as it is fixed."""
    if given is not None:
        return given, None
    if not config_path.exists():
        return pool_config.GatewayFileConfig(), None
    try:
        return pool_config.load(config_path), None
    except ConfigError as problem:
        fallback = pool_config.GatewayFileConfig()
        source = "the defaults (no earlier config loaded on this host)"
        if last_good_path.exists():
            try:
                fallback = pool_config.load(last_good_path)
                source = f"the last config that loaded ({last_good_path})"
            except ConfigError as exc:
                log.error("the last good config %s is unusable too: %s", last_good_path, exc)
        log.error("the pools file %s is broken, so the gateway runs on %s until it is fixed: %s", config_path,
                  source, problem)
        return fallback, problem


def first_byte_timeout_s(override_s: float | None, file_config: pool_config.GatewayFileConfig) -> float:
    """``--first-chunk-timeout`` when given, else the pools file's ``gateway.first_byte_timeout_s``."""
    if override_s is not None:
        return override_s
    return file_config.limits.first_byte_timeout_s


def file_trusted_networks(config: pool_config.GatewayFileConfig) -> tuple[Network, ...]:
    """The Go gateway's LAN trust: the file's ``local_networks`` while ``gateway.trust_local_networks`` is on."""
    return parse_networks(config.local_networks) if config.limits.trust_local_networks else ()


class PoolsFile:
    """The gateway's pools file (``config_path``) and what follows it; ``first_chunk_timeout_s`` and
    ``stale_after_s`` are the command line's overrides (None: the file's)."""

    def __init__(self, nc: Client, gateway_id: str, config_path: Path, file_config: pool_config.GatewayFileConfig,
                 auth: Auth, http: HttpBackend, first_chunk_timeout_s: float | None = None,
                 stale_after_s: float | None = None, config_poll_s: float = 1.0,
                 last_good_path: Path | None = None, problem: ConfigError | None = None) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.config_path = config_path
        self.file_config = file_config
        self.auth = auth
        self.http = http
        self.first_chunk_timeout_s = first_chunk_timeout_s
        self.stale_after_s_override = stale_after_s
        self.config_poll_s = config_poll_s
        self._config_mtime: float | None = None
        self.auth.file_trusted = file_trusted_networks(file_config)
        self.last_good_path = last_good_path
        # the file in force is not the file on disk: why (the Config page's banner, /health), None when it is
        self.problem = problem
        if problem is not None:
            self._config_mtime = _mtime(config_path)  # reload only once the file changes again
        else:
            self._keep_last_good(file_config)

    @property
    def first_byte_timeout_s(self) -> float:
        return first_byte_timeout_s(self.first_chunk_timeout_s, self.file_config)

    @property
    def stale_after_s(self) -> float:
        """``--stale-after`` when given, else the pools file's ``metrics.stale_threshold`` (reloads apply)."""
        if self.stale_after_s_override is not None:
            return self.stale_after_s_override
        return self.file_config.metrics.stale_threshold

    def _use_file_config(self, parsed: pool_config.GatewayFileConfig) -> None:
        """The one place a new pools file takes effect (reload, Config page, another gateway's save)."""
        self.file_config = parsed
        self.auth.max_concurrent_per_key = parsed.limits.max_concurrent_per_key
        self.auth.file_trusted = file_trusted_networks(parsed)
        self.http.first_byte_timeout_s = self.first_byte_timeout_s
        self.http.request_timeout_s = parsed.limits.request_timeout_s

    def config_dict(self) -> dict[str, Any]:
        return pool_config.to_dict(self.file_config)

    def _keep_last_good(self, config: pool_config.GatewayFileConfig) -> None:
        """A copy of a config that loaded, for a restart that finds the file broken (small: written in place)."""
        if self.last_good_path is None:
            return
        try:
            atomic_write_text(self.last_good_path, json.dumps(pool_config.to_dict(config), indent=2) + "\n")
        except OSError as exc:
            log.warning("could not keep a copy of the last good config at %s: %s", self.last_good_path, exc)

    async def apply_config(self, raw: dict[str, Any], broadcast: bool = True) -> ConfigError | None:
        """Validate, save atomically, apply now, and tell the other gateways; a bad config changes nothing."""
        try:
            parsed = pool_config.parse(raw)
        except ConfigError as exc:
            return exc
        text = json.dumps(raw, indent=2) + "\n"
        try:
            await asyncio.to_thread(atomic_write_text, self.config_path, text)
        except OSError as exc:
            # e.g. the compose layout mounts the file read-only: say so, change nothing (was a raw 500)
            reason = exc.strerror or str(exc)
            return ConfigError("config", f"{self.config_path} cannot be written ({reason}); nothing was changed. "
                                         "If it is mounted read-only, edit it on the host (the gateway reloads it "
                                         "when it changes) or mount it writable")
        self._use_file_config(parsed)
        self.problem = None
        await asyncio.to_thread(self._keep_last_good, parsed)
        self._config_mtime = _mtime(self.config_path)
        log.info("config saved to %s and applied: %d pool(s)", self.config_path, len(parsed.pools))
        if broadcast:
            await self._announce_config(raw)
        return None

    async def _announce_config(self, raw: dict[str, Any]) -> None:
        """Tell telemetry and the other gateways (``llm.v1.config.changed``) that the pools changed."""
        try:
            await self.nc.publish(subjects.CONFIG_CHANGED, pool_config.change_message(self.gateway_id, raw))
        except Exception as exc:
            log.warning("other gateways not told about the new config (bus: %s); they keep their own", exc)

    async def _on_config_changed(self, msg: Msg) -> None:
        try:
            change = pool_config.read_change_message(msg.data)
        except ConfigError as exc:
            log.error("kept the previous config: a config-changed message was refused: %s", exc)
            return
        if change.gateway_id == self.gateway_id:
            return
        try:
            await self.apply_config(change.raw, broadcast=False)  # already valid: read_change_message parsed it
        except OSError as exc:
            log.error("config from gateway %s not saved: %s", change.gateway_id, exc)

    def mark_seen(self) -> None:
        """The file as it is now counts as applied: :meth:`watch_config` reloads only a later change."""
        self._config_mtime = _mtime(self.config_path)

    async def watch_config(self) -> None:
        """Reload the pools file when it changes (and tell the bus); a broken file keeps the old config and says why."""
        while True:
            await asyncio.sleep(self.config_poll_s)
            mtime = _mtime(self.config_path)
            if mtime == self._config_mtime or mtime is None:
                continue
            self._config_mtime = mtime
            try:
                parsed = await asyncio.to_thread(pool_config.load, self.config_path)
            except ConfigError as exc:
                log.error("kept the previous config: %s", exc)
                self.problem = exc
                continue
            self.problem = None
            if parsed == self.file_config:
                continue  # rewritten with what we have (another gateway saved it into a shared file)
            self._use_file_config(parsed)
            await asyncio.to_thread(self._keep_last_good, parsed)
            log.info("reloaded %s: %d pool(s)", self.config_path, len(self.file_config.pools))
            await self._announce_config(pool_config.to_dict(parsed))  # as for a Config page save


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
