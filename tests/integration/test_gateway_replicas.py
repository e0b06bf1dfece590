"""Several gateways on one bus share users, API keys and quotas (services/gateway/identity_sync.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from proto import AuthCheck, encode_json, subjects
from services.common.bus import connect
from services.common.http import HTTPError
from services.gateway import peers as gateway_peers
from services.gateway.identity import hash_password, key_digest
from services.gateway.service import GatewayConfig, GatewayService
from tests.integration.conftest import wait_for


@pytest.fixture(autouse=True)
def fleet_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gateways with their own data directories share rows only with one fleet secret (identity_signing.py)."""
    monkeypatch.setenv("LLMGW_FLEET_SECRET", "replicas-test-fleet-secret")


@contextlib.asynccontextmanager
async def gateway(url: str, data_dir: Path, gateway_id: str) -> AsyncIterator[GatewayService]:
    client = await connect(url, gateway_id)
    try:
        g = GatewayService(client, GatewayConfig(gateway_id=gateway_id, port=0, data_dir=data_dir))
        async with g.running():
            yield g
    finally:
        with contextlib.suppress(Exception):
            await client.drain()


async def auth_check(nc, key: str) -> dict:  # type: ignore[no-untyped-def]
    msg = await nc.request(subjects.AUTH_CHECK, encode_json(AuthCheck(key_sha256=key_digest(key))), timeout=5)
    return msgspec.json.decode(msg.data)


async def test_a_key_made_on_one_gateway_works_on_another_with_one_quota(  # type: ignore[no-untyped-def]
        nats_server, nc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gateway_peers, "QUOTA_SHARE_S", 0.05)
    async with gateway(nats_server.url, tmp_path / "gw1", "gw1") as gw1:
        assert gw1.bootstrap is not None  # the first gateway of the fleet creates the admin
        async with gateway(nats_server.url, tmp_path / "gw2", "gw2") as gw2:
            assert gw2.bootstrap is None  # ... and only the first: the second has it from the bus
            assert [u.name for u in gw2.identity.users()] == ["admin"]
            admin_key = gw1.bootstrap[1]
            assert gw2.identity.lookup_key(key_digest(admin_key), time.time()) is not None

            # a user and a key made on gw1 (as its pages do) work on gw2
            bob = gw1.identity.create_user("bob", hash_password("bob-password-1"), "user")
            key, record = gw1.identity.create_key(bob.user_id, "laptop", 1000, time.time())
            await wait_for(lambda: gw2.identity.lookup_key(key_digest(key), time.time()) is not None, timeout_s=5)
            assert gw2.identity.password_hash("bob") is not None
            assert (await auth_check(nc, key))["key_id"] == record.key_id

            # one quota across the fleet: 900 tokens on gw1 and 150 on gw2 spend bob's 1000
            on_gw2 = gw2.identity.lookup_key(key_digest(key), time.time())
            assert on_gw2 is not None
            gw1.auth.finished(gw1.auth.admit_key(record, time.time()), 900, time.time())
            await wait_for(lambda: gw2.auth.used_today(record.key_id, time.time()) == 900, timeout_s=5)
            gw2.auth.finished(gw2.auth.admit_key(on_gw2, time.time()), 150, time.time())
            await wait_for(lambda: gw1.auth.used_today(record.key_id, time.time()) == 1050, timeout_s=5)
            for g in (gw1, gw2):
                with pytest.raises(HTTPError) as refused:
                    g.auth.admit_key(g.identity.key_by_id(record.key_id), time.time())  # type: ignore[arg-type]
                assert refused.value.status == 429 and refused.value.code == "quota_exceeded"

            # a quota raised and a key revoked on gw2 take effect on gw1
            gw2.identity.set_quota(record.key_id, 5000)
            await wait_for(lambda: gw1.identity.key_by_id(record.key_id).daily_quota == 5000, timeout_s=5)  # type: ignore[union-attr]
            gw1.auth.finished(gw1.auth.admit_key(gw1.identity.key_by_id(record.key_id), time.time()), 0,  # type: ignore[arg-type]
                              time.time())
            gw2.identity.revoke_key(record.key_id, time.time())
            await wait_for(lambda: gw1.identity.lookup_key(key_digest(key), time.time()) is None, timeout_s=5)
            assert (await auth_check(nc, key)) == {"ok": False}

    # a third gateway started later, with an empty data dir, knows everyone and creates no admin of its own
    async with gateway(nats_server.url, tmp_path / "gw3", "gw3") as gw3:
        assert gw3.bootstrap is None
        assert sorted(u.name for u in gw3.identity.users()) == ["admin", "bob"]
        assert gw3.identity.lookup_key(key_digest(admin_key), time.time()) is not None
        assert gw3.identity.lookup_key(key_digest(key), time.time()) is None  # revoked stays revoked
    printed = capsys.readouterr().out
    assert printed.count("first start: created user 'admin'") == 1


async def test_a_gateway_that_does_not_know_a_key_lets_one_that_does_answer(  # type: ignore[no-untyped-def]
        nats_server, nc, tmp_path: Path) -> None:
    async with gateway(nats_server.url, tmp_path / "gw1", "gw1") as gw1, \
            gateway(nats_server.url, tmp_path / "gw2", "gw2") as gw2:
        # a key only gw2 knows (written to its store behind replication's back, as by a lagging replica)
        gw2.identity.on_change = None
        user = gw2.identity.users()[0]
        key, record = gw2.identity.create_key(user.user_id, "local", None, time.time())
        assert gw1.identity.lookup_key(key_digest(key), time.time()) is None
        for _ in range(5):  # gw1 answers "no" later than gw2 answers "yes", every time
            assert (await auth_check(nc, key)).get("key_id") == record.key_id


async def test_a_change_made_with_llmgw_admin_reaches_the_running_gateways(  # type: ignore[no-untyped-def]
        nats_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.gateway import identity_sync
    from services.gateway.identity import IdentityStore
    monkeypatch.setattr(identity_sync, "RESYNC_S", 0.1)
    async with gateway(nats_server.url, tmp_path / "gw1", "gw1") as gw1, \
            gateway(nats_server.url, tmp_path / "gw2", "gw2") as gw2:
        assert gw1.bootstrap is not None
        key_id = gw1.identity.keys_of(None)[0].key_id
        shell = IdentityStore(tmp_path / "gw1" / "identity")  # what `llmgw admin set-quota` opens
        shell.set_quota(key_id, 777)
        shell.close()
        for g in (gw1, gw2):
            await wait_for(lambda g=g: g.identity.key_by_id(key_id).daily_quota == 777, timeout_s=15)  # type: ignore[misc,union-attr]


async def test_a_bootstrap_claim_no_gateway_of_the_fleet_signed_does_not_keep_the_fleet_without_an_admin(
        nats_server, nc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Another bus client puts an unsigned ``bootstrap`` key before any gateway starts (on the old code the
    first gateway then believed another had made the admin, and nobody ever did); a signed claim is obeyed."""
    js = nc.jetstream()
    from nats.js.api import KeyValueConfig

    kv = await js.create_key_value(KeyValueConfig(bucket=subjects.KV_IDENTITY, history=1))
    await kv.put("bootstrap", b"mallory")
    async with gateway(nats_server.url, tmp_path / "gw1", "gw1") as gw1:
        assert gw1.bootstrap is not None and [u.name for u in gw1.identity.users()] == ["admin"]
        entry = await kv.get("bootstrap")
        assert b"gw1" in (entry.value or b"")  # the claim is now gw1's, signed
        async with gateway(nats_server.url, tmp_path / "gw2", "gw2") as gw2:
            assert gw2.bootstrap is None  # a signed claim is obeyed


async def test_a_route_made_on_one_gateway_is_booked_and_remembered_on_another(  # type: ignore[no-untyped-def]
        nats_server, tmp_path: Path) -> None:
    # docs/routing.md §6: replicas share routes (RouteNotes on llm.v1.route.<gateway_id>), so a tenant's next
    # request through another replica finds its prefix and its pin, and bursts across replicas are booked
    from services.gateway import routing
    from services.gateway.routing_adapter import Decision

    keys = routing.prefix_hashes([{"role": "system", "content": "s" * 4000}, {"role": "user", "content": "hi"}])
    request = routing.RouteRequest(session_key="sess-7", is_session_header=True, prefix_keys=keys)
    decision = Decision(routing.Pick("w-b", "least_loaded", ("w-b",), ()), request, routing.PoolPolicy(), "p")
    async with gateway(nats_server.url, tmp_path / "gw1", "gw1") as gw1, \
            gateway(nats_server.url, tmp_path / "gw2", "gw2") as gw2:
        sharing = gw1.forwarder.sharing
        assert sharing is not None
        routed_s = time.time()
        sharing.routed("w-b", routed_s)  # what the forwarder does at book and at the first byte
        sharing.first_byte(decision, "w-b", routed_s + 0.1)
        await wait_for(lambda: gw2.router.affinity.lookup(keys, time.time()) is not None, timeout_s=120)
        assert list(gw2.fleet.record("w-b").peer_route_times) == [routed_s]
        assert gw2.router.affinity.lookup(keys, time.time()).member_id == "w-b"  # type: ignore[union-attr]
        assert gw2.router.pins.get("sess-7", time.time()) == "w-b"
        # its own notes come back on the bus too, and are ignored: gw1 books its own request once, itself
        assert list(gw1.fleet.record("w-b").peer_route_times) == []
