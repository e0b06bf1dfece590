"""The shipped deploy/nats/permissions.conf is what services/common/nats_auth.py enforces in `llmgw up`,
and nats-server accepts it (and refuses to start while a role's password variable is unset)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from services.common import nats_auth
from services.common.nats_server import find_binary

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "deploy" / "nats" / "permissions.conf"


def test_the_shipped_permissions_file_is_the_generated_one() -> None:
    assert SHIPPED.read_text() == nats_auth.permissions_conf(), (
        "regenerate: python -c 'from services.common.nats_auth import permissions_conf; "
        "open(\"deploy/nats/permissions.conf\", \"w\").write(permissions_conf())'")


def _check(conf: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([find_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30, env=env)


def test_nats_server_accepts_the_permissions_and_wants_every_password(tmp_path: Path) -> None:
    conf = tmp_path / "nats.conf"
    (tmp_path / "permissions.conf").write_text(SHIPPED.read_text())
    conf.write_text('listen: "127.0.0.1:-1"\ninclude permissions.conf\n')
    base = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    everyone = {**base, **{nats_auth.password_variable(r): f"pw-{r}" for r in nats_auth.ROLES}}
    ok = _check(conf, everyone)
    assert ok.returncode == 0, ok.stderr
    missing = dict(everyone)
    del missing["NATS_ENGINE_PASSWORD"]
    refused = _check(conf, missing)
    assert refused.returncode != 0 and "NATS_ENGINE_PASSWORD" in refused.stderr


def test_the_embedded_config_holds_bcrypt_hashes_not_passwords() -> None:
    creds = {r: f"password-of-{r}" for r in nats_auth.ROLES}
    text = nats_auth.authorization_conf(creds)
    assert text.count('"$2a$') == len(nats_auth.ROLES)
    assert not any(p in text for p in creds.values())


def test_credentials_are_made_once_and_kept_private(tmp_path: Path) -> None:
    first = nats_auth.load_or_create_credentials(tmp_path)
    assert set(first) == set(nats_auth.ROLES) and len(set(first.values())) == len(first)
    assert (tmp_path / nats_auth.CREDENTIALS_FILE).stat().st_mode & 0o077 == 0
    assert nats_auth.load_or_create_credentials(tmp_path) == first


def test_credentials_go_into_every_address_of_a_url_list() -> None:
    url = nats_auth.url_with_credentials("nats://a:4222, nats://old:pw@b:4222", "engine", "p@ss/w:rd")
    assert url == "nats://engine:p%40ss%2Fw%3Ard@a:4222,nats://engine:p%40ss%2Fw%3Ard@b:4222"


def test_named_engines_get_their_own_users_held_to_their_own_subjects(tmp_path: Path) -> None:
    """`llmgw bus-permissions --engine gpu-a`: a user engine.gpu-a whose subjects all name gpu-a, accepted by
    nats-server, which wants its password variable too."""
    from services.common.nats_auth import main

    out = tmp_path / "permissions.conf"
    main(["--engine", "gpu-a", "-o", str(out)])
    assert out.stat().st_mode & 0o077 == 0
    scoped = nats_auth.engine_permissions("gpu-a")
    own = [s for s in scoped["publish"]["allow"] + scoped["subscribe"]["allow"] if s.startswith(("llm.v1", "$KV"))]
    assert own and all(s.endswith(".gpu-a") for s in own), own
    (tmp_path / "nats.conf").write_text('listen: "127.0.0.1:-1"\ninclude permissions.conf\n')
    base = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    everyone = {**base, **{nats_auth.password_variable(r): f"pw-{r}" for r in nats_auth.ROLES}}
    refused = _check(tmp_path / "nats.conf", everyone)
    assert refused.returncode != 0 and "NATS_ENGINE_GPU_A_PASSWORD" in refused.stderr
    ok = _check(tmp_path / "nats.conf", {**everyone, "NATS_ENGINE_GPU_A_PASSWORD": "pw"})
    assert ok.returncode == 0, ok.stderr
    assert '"engine.gpu-a"' in out.read_text()


def test_no_service_role_may_destroy_a_stream() -> None:
    for role in ("gateway", "engine", "telemetry", "accounting"):
        deny = nats_auth.PERMISSIONS[role]["publish"]["deny"]
        assert {"$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>", "$JS.API.STREAM.MSG.DELETE.>"} <= set(deny), role
    assert "$JS.API.STREAM.UPDATE.>" not in nats_auth.PERMISSIONS["accounting"]["publish"]["deny"]  # it owns them
