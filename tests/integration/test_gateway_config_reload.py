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


async def test_a_pools_file_broken_at_restart_keeps_the_gateway_up_on_the_last_good_config(nc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue #25: a corrupt pools.json at restart crash-looped the gateway and stopped the whole stack."""
    import aiohttp

    from services.common.http import serving

    path = tmp_path / "pools.json"
    pool_file(path, "first", 1_000_000)
    first = GatewayService(nc, GatewayConfig(gateway_id="gw", port=0, data_dir=tmp_path, config_path=path,
                                             config_poll_s=0.05))
    assert pools.model_names(first.pools_file.file_config, first.fleet) == ["first"]
    assert (tmp_path / "pools.last-good.json").exists()  # kept at the load
    first.identity.close()
    path.write_text('{"model_pools": {"first": {"members": [ {"model_id": "x"')  # cut mid-write by an editor
    os.utime(path, (1_000_100, 1_000_100))
    again = GatewayService(nc, GatewayConfig(gateway_id="gw", port=0, data_dir=tmp_path, config_path=path,
                                             config_poll_s=0.05))
    assert pools.model_names(again.pools_file.file_config, again.fleet) == ["first"]  # the last good one
    assert again.pools_file.problem is not None and "not valid JSON" in str(again.pools_file.problem)
    async with again.running(), serving(again.app(), "127.0.0.1", 0) as url, aiohttp.ClientSession() as http:
        async with http.get(url + "/health") as r:
            assert "not valid JSON" in (await r.json())["config_error"]
        pool_file(path, "fixed", 1_000_200)  # fixed on disk: taken, and the problem is gone
        await wait_for(lambda: pools.model_names(again.pools_file.file_config, again.fleet) == ["fixed"], 5)
        assert again.pools_file.problem is None
        async with http.get(url + "/health") as r:
            assert (await r.json())["config_error"] is None


async def test_a_save_to_a_read_only_pools_file_says_so_and_changes_nothing(nc, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue #25: the compose layout mounts the config read-only, and a save answered a raw JSON 500. The
    mount is faked at the write (these tests run as root, which ignores file modes)."""
    import errno

    from services.gateway import pools_file

    path = tmp_path / "pools.json"
    pool_file(path, "first", 1_000_000)
    gateway = GatewayService(nc, GatewayConfig(gateway_id="gw", port=0, data_dir=tmp_path, config_path=path),
                             pool_config.load(path))

    def read_only(target: Path, text: str) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(target))
    monkeypatch.setattr(pools_file, "atomic_write_text", read_only)
    raw = pool_config.to_dict(gateway.pools_file.file_config)
    raw["model_pools"]["second"] = raw["model_pools"].pop("first")
    problem = await gateway.pools_file.apply_config(raw)
    assert problem is not None and "Read-only file system" in problem.reason and "read-only" in problem.reason
    assert problem.key == "config"
    assert pools.model_names(gateway.pools_file.file_config, gateway.fleet) == ["first"]  # nothing changed
