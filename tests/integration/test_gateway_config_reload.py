"""The pools file is reloaded on change; a broken file keeps the old config."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from proto import pools as pool_config
from services.gateway import pools
from services.gateway.service import GatewayConfig, GatewayService
from tests.integration.conftest import wait_for


def pool_file(path: Path, name: str, mtime: float) -> None:
    path.write_text(json.dumps({"model_pools": {name: {"members": [
        {"model_id": name, "backend": "http://127.0.0.1:9"}]}}}))
    os.utime(path, (mtime, mtime))  # a distinct mtime even within one filesystem tick


async def test_a_changed_pools_file_is_reloaded_and_a_broken_one_is_refused(nc, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.ERROR, logger="services.gateway.pools_file")
    path = tmp_path / "pools.json"
    pool_file(path, "first", 1_000_000)
    gateway = GatewayService(nc, GatewayConfig(gateway_id="gw", port=0, data_dir=tmp_path, config_path=path,
                                               config_poll_s=0.05), pool_config.load(path))

    def names() -> list[str]:
        return pools.model_names(gateway.pools_file.file_config, gateway.fleet)

    async with gateway.running():
        assert names() == ["first"]
        pool_file(path, "second", 1_000_100)
        await wait_for(lambda: names() == ["second"], timeout_s=5)
        path.write_text('{"model_pools": {"third": {"members": []}}}')  # invalid: no members
        os.utime(path, (1_000_200, 1_000_200))
        await wait_for(lambda: "kept the previous config" in caplog.text, timeout_s=5)
        assert "model_pools.third.members" in caplog.text  # the log names the key
        assert names() == ["second"]  # the old config stays in force


async def test_the_stale_threshold_comes_from_the_pools_file_unless_the_flag_names_one(nc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "pools.json"
    path.write_text(json.dumps({"metrics": {"stale_threshold": 7.5}, "model_pools": {"p": {"members": [
        {"model_id": "p", "backend": "http://127.0.0.1:9"}]}}}))
    os.utime(path, (1_000_000, 1_000_000))
    gateway = GatewayService(nc, GatewayConfig(gateway_id="gw", port=0, data_dir=tmp_path, config_path=path,
                                               config_poll_s=0.05), pool_config.load(path))
    async with gateway.running():
        assert gateway.pools_file.stale_after_s == 7.5
        assert gateway.forwarder.weights().stale_after_s == 7.5
        path.write_text(json.dumps({"metrics": {"stale_threshold": 1.5}, "model_pools": {"p": {"members": [
            {"model_id": "p", "backend": "http://127.0.0.1:9"}]}}}))
        os.utime(path, (1_000_100, 1_000_100))
        await wait_for(lambda: gateway.pools_file.stale_after_s == 1.5, timeout_s=5)  # a reload applies it
    flagged = GatewayService(nc, GatewayConfig(gateway_id="gw2", port=0, data_dir=tmp_path / "b",
                                               stale_after_s=2.0), pool_config.load(path))
    assert flagged.pools_file.stale_after_s == 2.0  # --stale-after wins over the file


async def test_an_edited_pools_file_is_announced_on_the_bus_once(nc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from proto import subjects
    heard: list[pool_config.ConfigChange] = []

    async def on_change(msg) -> None:  # type: ignore[no-untyped-def]
        heard.append(pool_config.read_change_message(msg.data))
    sub = await nc.subscribe(subjects.CONFIG_CHANGED, cb=on_change)
    path = tmp_path / "pools.json"
    pool_file(path, "first", 1_000_000)
    gateway = GatewayService(nc, GatewayConfig(gateway_id="gw", port=0, data_dir=tmp_path, config_path=path,
                                               config_poll_s=0.05), pool_config.load(path))
    async with gateway.running():
        pool_file(path, "second", 1_000_100)  # telemetry and the other gateways learn of it
        await wait_for(lambda: len(heard) == 1, timeout_s=5)
        assert heard[0].gateway_id == "gw" and list(heard[0].raw["model_pools"]) == ["second"]
        pool_file(path, "second", 1_000_200)  # the same content written again (a shared file): no echo
        await wait_for(lambda: gateway.pools_file._config_mtime == 1_000_200, timeout_s=5)
        await nc.flush()
        assert len(heard) == 1
    await sub.unsubscribe()
