"""Issue #25: deploy/env.example documented LLMGW_ADMIN_PASSWORD and LLMGW_SECRET_KEY, which nothing read.
Every variable it names is read by the code, by compose.yaml or by the shipped NATS configs;
LLMGW_ADMIN_PASSWORD sets the first admin's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.gateway import peers
from services.gateway.identity import IdentityStore

ROOT = Path(__file__).resolve().parents[2]
# names compose itself reads (not the services): https://docs.docker.com/compose/environment-variables/envvars/
COMPOSE_OWN = {"COMPOSE_PROFILES", "COMPOSE_PROJECT_NAME", "COMPOSE_FILE"}


def _documented() -> set[str]:
    text = (ROOT / "deploy" / "env.example").read_text()
    return set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", text, re.M))


def _read_somewhere(name: str) -> bool:
    sources = [p.read_text() for p in (ROOT / "services").rglob("*.py")]
    sources += [(ROOT / "compose.yaml").read_text()]
    # nats-server reads $NAME in its config files (deploy/nats/permissions.conf: the role users' passwords)
    sources += [p.read_text() for p in (ROOT / "deploy" / "nats").glob("*.conf")]
    return any(re.search(rf"\b{name}\b", text) for text in sources)


def test_every_variable_env_example_documents_is_read() -> None:
    unread = sorted(n for n in _documented() - COMPOSE_OWN if not _read_somewhere(n))
    assert unread == [], f"documented in deploy/env.example but read nowhere: {unread}"


def test_llmgw_admin_password_is_the_first_admins_and_is_not_printed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from services.gateway.identity import verify_password

    monkeypatch.setenv("LLMGW_ADMIN_PASSWORD", "operator-chosen-secret")
    store = IdentityStore(tmp_path / "identity")
    try:
        peers.bootstrap_admin(store)
        found = store.password_hash("admin")
        assert found is not None and verify_password("operator-chosen-secret", found[1])
        assert "operator-chosen-secret" not in capsys.readouterr().out
    finally:
        store.close()
    monkeypatch.setenv("LLMGW_ADMIN_PASSWORD", "short")
    store = IdentityStore(tmp_path / "other")
    try:
        with pytest.raises(Exception, match="LLMGW_ADMIN_PASSWORD"):
            peers.bootstrap_admin(store)
    finally:
        store.close()
