"""A Go llm-gateway config file runs a real gateway with its upstream meaning (issue #24): its port, its LAN
trust (never for loopback), models_require_auth; capacity_weight 0 weighs a member by its lanes."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from proto import SlotHeartbeat
from proto import pools as pool_config
from services.common.bus import connect, ensure_bus
from services.common.http import serving
from services.gateway import __main__ as gateway_main
from services.gateway.auth import Auth
from services.gateway.pools import MemberRef
from services.gateway.pools_file import file_trusted_networks
from services.gateway.routing_adapter import effective_weight
from services.gateway.service import GatewayConfig, GatewayService
from tests.unit.test_pools_upstream import UPSTREAM


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gateway_main.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_the_files_gateway_port_is_the_listen_port_unless_a_flag_or_the_environment_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_PORT", raising=False)
    cfg = pool_config.parse(json.loads(json.dumps(UPSTREAM)))
    assert gateway_main.build_config(_args("--data-dir", str(tmp_path)), cfg).port == 8035
    assert gateway_main.build_config(_args("--data-dir", str(tmp_path), "--port", "9000"), cfg).port == 9000
    assert gateway_main.build_config(_args("--data-dir", str(tmp_path)), None).port == gateway_main.DEFAULT_PORT
    monkeypatch.setenv("LLMGW_PORT", "9100")
    assert gateway_main.build_config(_args("--data-dir", str(tmp_path)), cfg).port == 9100


def test_local_networks_are_trusted_only_while_trust_local_networks_is_on_and_never_for_loopback(
        tmp_path: Path) -> None:
    raw = {"gateway": {"trust_local_networks": True}, "local_networks": ["192.168.1.0/24", "127.0.0.0/8"]}
    auth = Auth.__new__(Auth)  # only is_trusted's state
    auth.trusted, auth.file_trusted = (), file_trusted_networks(pool_config.parse(raw))
    assert auth.is_trusted(SimpleNamespace(remote="192.168.1.7"))  # type: ignore[arg-type]
    assert not auth.is_trusted(SimpleNamespace(remote="10.0.0.7"))  # type: ignore[arg-type]
    assert not auth.is_trusted(SimpleNamespace(remote="127.0.0.1"))  # type: ignore[arg-type]
    raw["gateway"]["trust_local_networks"] = False  # type: ignore[index]
    assert file_trusted_networks(pool_config.parse(raw)) == ()
    with pytest.raises(pool_config.ConfigError, match=r"local_networks\[1\]"):
        pool_config.parse({"local_networks": ["10.0.0.0/8", "lan"]})


def test_capacity_weight_zero_weighs_a_member_by_its_lanes() -> None:
    ref = MemberRef("a", "m", "http", None, capacity_weight=0.0)
    beat = SlotHeartbeat(worker_id="a", session_id="s", seq=1, ts_s=0.0, model_id="m", lanes=12)
    assert effective_weight(ref, beat) == 12.0 and effective_weight(ref, None) == 1.0
    assert effective_weight(MemberRef("b", "m", "http", None, capacity_weight=8.0), beat) == 8.0


@pytest.mark.parametrize("required", [False, True])
async def test_models_require_auth_gates_the_catalogue(nats_server, tmp_path: Path, required: bool) -> None:  # type: ignore[no-untyped-def]
    raw = json.loads(json.dumps(UPSTREAM))
    raw["gateway"]["models_require_auth"] = required
    async with contextlib.AsyncExitStack() as es:
        nc = await connect(nats_server.url, "gateway")
        es.push_async_callback(nc.close)
        await ensure_bus(nc)
        gateway = GatewayService(nc, GatewayConfig(gateway_id="gwu", port=0, data_dir=tmp_path),
                                 pool_config.parse(raw))
        await es.enter_async_context(gateway.running())
        url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        assert gateway.bootstrap is not None
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/v1/models") as resp:
                assert resp.status == (401 if required else 200)
                body = await resp.json()
                if required:
                    assert body["error"]["code"] == "missing_api_key"
                else:
                    assert [m["id"] for m in body["data"]] == ["q", "qwen"]
            headers = {"Authorization": f"Bearer {gateway.bootstrap[1]}"}
            async with http.get(url + "/v1/models/qwen", headers=headers) as resp:
                assert resp.status == 200
