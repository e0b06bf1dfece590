"""The deployment files, checked by the tools that will read them: a real Compose implementation
(``docker-compose config``: the Compose spec schema, interpolation, profiles; no Docker engine needed),
``nats-server -t``, ``systemd-analyze verify``, ShellCheck, the engine's own argument parser, and
``scripts/install-engine.sh`` run for real into a temporary root; and the comma-separated ``NATS_URL`` the
guide recommends, against two real nats-servers.

The system tools come from Debian via ``scripts/install-test-tools.sh`` (which ``.ci/run`` calls). Without
them these tests skip on a developer machine and fail under ``LLMGW_CI=1``.
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from nats.aio.msg import Msg

from proto import pools as pool_config
from services.common import nats_auth
from services.common.bus import connect
from services.common.nats_server import EmbeddedNatsServer, find_binary
from services.engine.__main__ import add_arguments as engine_arguments
from tests.e2e.procs import REPO

COMPOSE = REPO / "compose.yaml"
OBSERVABILITY = REPO / "deploy" / "observability"
MONITORING = ("prometheus", "grafana")  # the services of the `observability` profile
ENV_EXAMPLE = REPO / "deploy" / "env.example"
UNITS = REPO / "deploy" / "systemd"
INSTALL = REPO / "scripts" / "install-engine.sh"

# The runbook's engine command line (../shared/reference/interop.md), word for word.
RUNBOOK = shlex.split("""
ninfer-serve /var/lib/ninfer/qwen3_8_27b_nvfp4_v3.ninfer \
  --host 0.0.0.0 --port 8006 --model-id qwen3.8-27b \
  --max-context 262144 --kv-dtype fp8 \
  --max-concurrency 8 --max-pending-requests 64 \
  --spec mtp --draft-tokens 4 --lm-head-draft \
  --preserve-thinking --electricity-rate 0.125 \
  --metrics-state /var/lib/ninfer/metrics-state.json
""")


# the role users of deploy/nats/permissions.conf, as an operator's .env would set them
ROLE_PASSWORDS = {nats_auth.password_variable(role): f"pw-{role}" for role in nats_auth.ROLES}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed: run scripts/install-test-tools.sh as root"
        if os.environ.get("LLMGW_CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def compose_config(*args: str, compose_file: Path = COMPOSE) -> subprocess.CompletedProcess[str]:
    """``docker-compose config`` with the committed env example standing in for an operator's .env."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "COMPOSE_", "NATS_"))}
    env |= ROLE_PASSWORDS  # what an operator's .env may set (env.example leaves them commented out)
    return subprocess.run([tool("docker-compose"), "-f", str(compose_file), "--project-directory", str(REPO),
                           "--env-file", str(ENV_EXAMPLE), *args, "config"],
                          capture_output=True, text=True, timeout=60, env=env)


def resolved(*profiles: str) -> dict[str, Any]:
    out = compose_config(*(arg for p in profiles for arg in ("--profile", p)))
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def mounts(svc: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target → (source, read_only), from the short ("src:dst:ro") or the long syntax."""
    found = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            found[target] = (source, mode == ["ro"])
        else:
            found[v["target"]] = (v["source"], bool(v.get("read_only")))
    return found


def enabled(services: dict[str, Any], *profiles: str) -> set[str]:
    """The services `docker compose --profile …` starts (Compose v1's `config` lists them all)."""
    return {name for name, svc in services.items() if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)}


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer-serve", exit_on_error=False)
    engine_arguments(parser)
    return parser


# ---- compose ------------------------------------------------------------------------------------------


def test_compose_file_is_valid_for_every_profile_and_each_profile_picks_its_engine() -> None:
    core = {"nats", "gateway", "telemetry", "accounting"}
    assert enabled(resolved()["services"]) == core
    assert enabled(resolved("gpu")["services"], "gpu") == core | {"engine"}
    assert enabled(resolved("cpu")["services"], "cpu") == core | {"engine-cpu"}


@pytest.mark.parametrize("profile", ["", "cpu", "gpu", "observability"])
def test_compose_needs_no_env_file_and_serves_the_model_id_the_readme_asks_for(profile: str, tmp_path: Path) -> None:
    # issue #30: `docker compose up` on a fresh clone failed with "Couldn't find env file"; compose served
    # "demo" while the README's curl line asks for "demo-qwen3"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "COMPOSE_", "NATS_", "GF_"))}
    args = ["--profile", profile] if profile else []
    clone = tmp_path / "clone"  # the committed compose file in a directory with no .env, as a fresh clone has
    clone.mkdir()
    shutil.copy(COMPOSE, clone / "compose.yaml")
    out = subprocess.run([tool("docker-compose"), "-f", str(clone / "compose.yaml"), *args, "config"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=clone)
    assert out.returncode == 0, out.stderr
    assert "env file" not in out.stderr.lower()
    services = yaml.safe_load(out.stdout)["services"]
    readme_model = re.search(r'"model":"([^"]+)"', (REPO / "README.md").read_text()).group(1)  # type: ignore[union-attr]
    for name in ("engine", "engine-cpu"):
        if name in services and (not profile or profile in services[name].get("profiles", [])):
            assert f"--model-id={readme_model}" in services[name]["command"]
    for svc in services.values():
        for key, value in (svc.get("environment") or {}).items():
            assert "${" not in str(value), (key, value)  # every default interpolated
    gateway = services["gateway"]["environment"]
    assert gateway["LLMGW_NATS_HOST"] == "nats:4222" and gateway["LLMGW_GATEWAY_ID"] == "gw-1"
    assert not gateway.get("LLMGW_ADMIN_PASSWORD")  # generated at first start and shown once


def test_the_compose_check_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("condition: service_healthy", "condition: service_happy", 1))
    out = compose_config(compose_file=broken)
    assert out.returncode != 0 and "service_happy" in out.stderr


def test_every_service_has_a_healthcheck_a_restart_policy_and_waits_for_a_healthy_nats() -> None:
    services = resolved("gpu", "cpu", "observability")["services"]
    for name, svc in services.items():
        assert svc["restart"] == "unless-stopped", name
        assert svc["healthcheck"]["test"][0] == "CMD", name
        if name not in ("nats", *MONITORING):
            assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name
            # our image may lack curl: the checks are Python one-liners against /health
            assert svc["healthcheck"]["test"][1:3] == ["python", "-c"] and "/health" in svc["healthcheck"]["test"][3]
            assert svc["image"].startswith("llmgw:") and svc["build"]["context"] == str(REPO), name


def test_the_gpu_engine_reserves_a_gpu_and_the_cpu_engine_needs_none() -> None:
    services = resolved("gpu", "cpu")["services"]
    gpu, cpu = services["engine"], services["engine-cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["build"]["args"]["TORCH_VARIANT"].startswith("cu") and "--device=cuda" in gpu["command"]
    assert "deploy" not in cpu and "--device=cpu" in cpu["command"]
    assert cpu["build"]["args"]["TORCH_VARIANT"] == "cpu"


def test_engine_commands_are_accepted_by_ninfer_serve_and_keep_metrics_state_on_a_volume() -> None:
    services = resolved("gpu", "cpu")["services"]
    for name in ("engine", "engine-cpu"):
        svc = services[name]
        assert svc["command"][0] == "engine"
        args = engine_parser().parse_args(svc["command"][1:])
        assert args.model_path.startswith("/models/") and args.host == "0.0.0.0" and args.port == 8006
        assert mounts(svc)["/var/lib/llmgw"] == ("engine-state", False)  # a named volume
        assert Path(args.metrics_state).parent == Path("/var/lib/llmgw")
        assert mounts(svc)["/models"] == (str(REPO / "models"), True)
        # joins the bus as a worker, as the engine user of deploy/nats/permissions.conf
        assert svc["entrypoint"] == ["/bin/sh", "/usr/local/bin/with-bus-user", "engine"]


def test_every_service_joins_the_bus_as_its_own_role_and_nats_loads_the_permissions() -> None:
    services = resolved("cpu")["services"]
    script = REPO / "deploy" / "compose" / "with-bus-user.sh"
    for name, role in (("gateway", "gateway"), ("accounting", "accounting"), ("telemetry", "telemetry"),
                       ("engine-cpu", "engine")):
        svc = services[name]
        assert svc["entrypoint"] == ["/bin/sh", "/usr/local/bin/with-bus-user", role], name
        assert mounts(svc)["/usr/local/bin/with-bus-user"] == (str(script), True)
        assert mounts(svc)["/run/llmgw-bus"] == ("bus-secrets", True)  # reads its password, writes nothing
    nats = services["nats"]
    source, read_only = mounts(nats)["/etc/nats/permissions.conf"]
    assert Path(source) == REPO / "deploy" / "nats" / "permissions.conf" and read_only
    assert "include permissions.conf" in (REPO / "deploy" / "nats" / "nats.conf").read_text()
    assert nats["entrypoint"] == ["/bin/sh", "/etc/nats/nats-start.sh"]
    assert mounts(nats)["/run/llmgw-bus"] == ("bus-secrets", False)
    # every role's password reaches the server from .env when set (else it is generated: below)
    assert set(nats["environment"]) == {*ROLE_PASSWORDS, "LLMGW_ENGINE_WORKER_ID"}


def _run_script(script: str, env: dict[str, str], fake: str, tmp_path: Path, *args: str) -> str:
    """Run deploy/compose/<script> with a stand-in ``fake`` command on PATH that prints its environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / fake
    stub.write_text('#!/bin/sh\necho "ARGS=$*"; env | grep -E "^NATS_" | sort\n')
    stub.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "LLMGW_"))}
    out = subprocess.run(["/bin/sh", str(REPO / "deploy" / "compose" / script), *args], capture_output=True,
                         text=True, timeout=30, env={**clean, "PATH": f"{bin_dir}:{clean['PATH']}", **env})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_compose_bus_passwords_are_generated_once_without_an_env_file_and_each_service_uses_its_own(
        tmp_path: Path) -> None:
    secrets = tmp_path / "bus-secrets"
    secrets.mkdir()
    env = {"LLMGW_BUS_SECRETS_DIR": str(secrets), "LLMGW_NATS_ETC": str(REPO / "deploy" / "nats"),
           "LLMGW_NATS_CONF_DIR": str(tmp_path / "conf")}
    first = _run_script("nats-start.sh", env, "nats-server", tmp_path)
    assert f"ARGS=-c {tmp_path / 'conf' / 'nats.conf'}" in first
    passwords = {role: (secrets / role).read_text() for role in nats_auth.ROLES}
    assert all(len(p) == 32 and p.isalnum() for p in passwords.values()) and len(set(passwords.values())) == 5
    assert all(f"{nats_auth.password_variable(r)}={p}" in first for r, p in passwords.items())
    assert all((secrets / r).stat().st_mode & 0o077 == 0 for r in nats_auth.ROLES)  # 0600
    again = _run_script("nats-start.sh", env, "nats-server", tmp_path)  # a restart keeps them
    assert {role: (secrets / role).read_text() for role in nats_auth.ROLES} == passwords
    assert "generated" in first and "generated" not in again
    chosen = _run_script("nats-start.sh", {**env, "NATS_GATEWAY_PASSWORD": "from-env-file"}, "nats-server", tmp_path)
    assert "NATS_GATEWAY_PASSWORD=from-env-file" in chosen and (secrets / "gateway").read_text() == "from-env-file"
    # each service builds its URL from its own role's password, or takes .env's NATS_URL as it is
    joined = _run_script("with-bus-user.sh", env, "llmgw", tmp_path, "engine", "engine", "/models/x")
    assert f"NATS_URL=nats://engine:{passwords['engine']}@nats:4222" in joined and "ARGS=engine /models/x" in joined
    elsewhere = _run_script("with-bus-user.sh", {**env, "NATS_URL": "nats://u:p@bus.example:4222"}, "llmgw",
                            tmp_path, "gateway", "gateway")
    assert "NATS_URL=nats://u:p@bus.example:4222" in elsewhere


@pytest.mark.parametrize("ids", [None, "my-engine"])
def test_compose_nats_holds_the_engine_user_to_the_compose_engines_ids(tmp_path: Path, ids: str | None) -> None:
    """nats-start.sh rewrites the shipped permissions.conf so the engine user's subjects name the compose engines'
    worker ids (the two profiles' defaults, or LLMGW_ENGINE_WORKER_ID), and the real nats-server accepts it."""
    (tmp_path / "s").mkdir()
    env = {"LLMGW_BUS_SECRETS_DIR": str(tmp_path / "s"), "LLMGW_NATS_ETC": str(REPO / "deploy" / "nats"),
           "LLMGW_NATS_CONF_DIR": str(tmp_path / "conf"), **({"LLMGW_ENGINE_WORKER_ID": ids} if ids else {})}
    _run_script("nats-start.sh", env, "nats-server", tmp_path)
    text = (tmp_path / "conf" / "permissions.conf").read_text()
    engine_line = text.split('user: "engine",', 1)[1].splitlines()[1]
    want = ["my-engine"] if ids else ["engine-gpu0", "engine-cpu0"]
    for subject in ("llm.v1.hb", "llm.v1.energy", "llm.v1.gen", "llm.v1.cancel", "llm.v1.embed"):
        assert f'"{subject}.*"' not in engine_line
        assert all(f'"{subject}.{i}"' in engine_line for i in want), engine_line
    assert '"llm.v1.gen.*"' in text  # the gateway's own wildcards are untouched
    out = subprocess.run([find_binary(), "-t", "-c", str(tmp_path / "conf" / "nats.conf")], capture_output=True,
                         text=True, timeout=30, env={**os.environ, **ROLE_PASSWORDS})
    assert out.returncode == 0, out.stderr


def test_state_lives_on_named_volumes_and_only_the_gateway_is_published() -> None:
    config = resolved("cpu")
    services = config["services"]
    assert set(config["volumes"]) >= {"nats-data", "ledger", "engine-state", "gateway-data"}
    volume_of = {name: {src: dst for dst, (src, _) in mounts(svc).items()
                        if not src.startswith("/") and src != "bus-secrets"}  # (the bus test covers that one)
                 for name, svc in services.items()}
    assert volume_of["accounting"] == {"ledger": "/var/lib/llmgw"}  # DuckDB: DATA_DIR/accounting.duckdb
    assert volume_of["gateway"] == {"gateway-data": "/var/lib/llmgw"}
    assert volume_of["nats"] == {"nats-data": "/data"}
    published = {name: svc["ports"] for name, svc in services.items()
                 if svc.get("ports") and name in enabled(services, "cpu")}
    assert list(published) == ["gateway"]
    assert published["gateway"][0]["target"] == 8080 and str(published["gateway"][0]["published"]) == "8080"
    # with the monitoring profile, Grafana too, but on the host's loopback only; Prometheus stays internal
    services = resolved("cpu", "observability")["services"]
    published = {name: svc["ports"] for name, svc in services.items()
                 if svc.get("ports") and name in enabled(services, "cpu", "observability")}
    assert sorted(published) == ["gateway", "grafana"]
    # Compose v1 writes a port bound to an address in the short form ("127.0.0.1:3000:3000/tcp")
    assert [p if isinstance(p, str) else f'{p["host_ip"]}:{p["published"]}:{p["target"]}/tcp'
            for p in published["grafana"]] == ["127.0.0.1:3000:3000/tcp"]
    assert volume_of["accounting"] == {"ledger": "/var/lib/llmgw"}
    monitoring_volumes = {name: {src for _, (src, _) in mounts(services[name]).items() if not src.startswith("/")}
                          for name in MONITORING}
    assert monitoring_volumes == {"prometheus": {"prometheus-data"}, "grafana": {"grafana-data"}}


def test_nats_runs_the_committed_config_with_jetstream_on_its_volume_and_an_8mb_payload() -> None:
    nats = resolved()["services"]["nats"]
    assert nats["image"].startswith("nats:") and nats["entrypoint"] == ["/bin/sh", "/etc/nats/nats-start.sh"]
    assert 'exec nats-server -c "$conf/nats.conf"' in (REPO / "deploy" / "compose" / "nats-start.sh").read_text()
    source, read_only = mounts(nats)["/etc/nats/nats.conf"]
    assert Path(source) == REPO / "deploy" / "nats" / "nats.conf" and read_only
    assert mounts(nats)["/data"] == ("nats-data", False)
    conf = Path(source).read_text()
    assert re.search(r"^max_payload: 8MB$", conf, re.M)
    assert re.search(r"store_dir: /data/jetstream", conf)


def test_no_secrets_in_the_compose_file_and_the_env_example_only_holds_placeholders() -> None:
    text = COMPOSE.read_text()
    # a secret may only be passed through from .env, empty by default: ${NAME:-}
    passed_through = re.sub(r"\$\{[A-Z_]+:-\}", "", text)
    assert not re.search(r"(?i)(password|secret|api_key|token)[ \t]*[:=][ \t]*\S", passed_through)
    for svc in resolved("gpu", "cpu")["services"].values():
        if svc["image"].startswith("llmgw"):
            assert not svc.get("environment", {}).get("NINFER_API_KEY")
    for line in ENV_EXAMPLE.read_text().splitlines():
        if re.match(r"^\s*[A-Z_]*(PASSWORD|SECRET|API_KEY|TOKEN)[A-Z_]*=", line):
            raise AssertionError(f"a secret is set in env.example: {line}")
    # the env file names a Compose profile and the example pools file is valid for the gateway
    assert re.search(r"^COMPOSE_PROFILES=(cpu|gpu)$", ENV_EXAMPLE.read_text(), re.M)
    assert pool_config.load(REPO / "deploy" / "config" / "pools.example.json").pools


# ---- monitoring (profile `observability`) ---------------------------------------------------------------
# What the dashboard and the alert rules query is checked against real /metrics output in
# tests/integration/test_observability.py; here: the profile, the images, the mounts, and that every scrape
# target, datasource and provider path names what compose really runs.


def test_the_observability_profile_adds_prometheus_and_grafana_and_nothing_else() -> None:
    core = {"nats", "gateway", "telemetry", "accounting"}
    assert enabled(resolved("observability")["services"], "observability") == core | set(MONITORING)
    assert enabled(resolved("cpu", "observability")["services"], "cpu", "observability") == (
        core | {"engine-cpu"} | set(MONITORING))
    services = resolved("observability")["services"]
    for name in MONITORING:
        assert services[name]["profiles"] == ["observability"], name


def test_monitoring_images_are_pinned_and_their_configs_are_the_committed_files_mounted_read_only() -> None:
    services = resolved("observability")["services"]
    prom, grafana = services["prometheus"], services["grafana"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prom["image"])
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"])
    prom_mounts = mounts(prom)
    assert prom_mounts["/etc/prometheus/prometheus.yml"] == (str(OBSERVABILITY / "prometheus" / "prometheus.yml"), True)
    assert prom_mounts["/etc/prometheus/alerts.yml"] == (str(OBSERVABILITY / "prometheus" / "alerts.yml"), True)
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert "--storage.tsdb.path=/prometheus" in prom["command"] and prom_mounts["/prometheus"][0] == "prometheus-data"
    graf_mounts = mounts(grafana)
    assert graf_mounts["/etc/grafana/provisioning"] == (str(OBSERVABILITY / "grafana" / "provisioning"), True)
    assert graf_mounts["/var/lib/grafana/dashboards"] == (str(OBSERVABILITY / "grafana" / "dashboards"), True)
    for _, (source, _) in [*prom_mounts.items(), *graf_mounts.items()]:
        assert not source.startswith("/") or Path(source).exists(), source
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    # the home dashboard is one the provider serves
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent == Path("/var/lib/grafana/dashboards")
    assert (OBSERVABILITY / "grafana" / "dashboards" / Path(home).name).is_file()


def _port_of(svc: dict[str, Any]) -> int:
    """The port a service of ours listens on, as its command line or environment says."""
    command = svc["command"]
    for i, word in enumerate(command):
        if word == "--port":
            return int(command[i + 1])
        if word.startswith("--port="):
            return int(word.split("=", 1)[1])
    (port,) = [v for k, v in svc.get("environment", {}).items() if k.endswith("_PORT")]
    return int(port)


def test_prometheus_scrapes_every_service_by_its_compose_name_and_listening_port_and_loads_the_rules() -> None:
    services = resolved("gpu", "cpu", "observability")["services"]
    config = yaml.safe_load((OBSERVABILITY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"gateway", "telemetry", "ninfer"}
    for job in ("gateway", "telemetry"):
        (target,) = [t for sc in jobs[job]["static_configs"] for t in sc["targets"]]
        host, port = target.split(":")
        assert host == job and int(port) == _port_of(services[host]), target
        svc = services[host]
        assert port in svc.get("expose", []) or [p["target"] for p in svc.get("ports", [])] == [int(port)], target
    (dns,) = jobs["ninfer"]["dns_sd_configs"]
    assert dns["type"] == "A" and set(dns["names"]) == {"engine", "engine-cpu"}
    for name in dns["names"]:  # both engine flavours, each under its own profile
        assert dns["port"] == _port_of(services[name]) and services[name]["command"][0] == "engine"
    # the engines' and the telemetry's /metrics path is Prometheus' default
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in jobs.values())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    rules = yaml.safe_load((OBSERVABILITY / "prometheus" / "alerts.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert {"MemberDown", "HeartbeatStale", "QueueGrowing", "EnergyCoverageFalling"} <= set(alerts)
    for name, rule in alerts.items():
        assert rule["expr"].strip() and re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in ("critical", "warning") and rule["annotations"]["summary"], name


def test_grafana_provisioning_reads_the_compose_prometheus_and_serves_the_mounted_dashboards() -> None:
    services = resolved("observability")["services"]
    provisioning = OBSERVABILITY / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    host_port = source["url"].removeprefix("http://")
    assert host_port == "prometheus:" + services["prometheus"]["expose"][0]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "llmgw.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] in mounts(services["grafana"])
    for path in (OBSERVABILITY / "grafana" / "dashboards").glob("*.json"):
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"] and dashboard["panels"], path
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        # the datasource variable defaults to the provisioned uid, and every panel reads through it
        assert variables["datasource"]["current"]["value"] == source["uid"]
        for panel in dashboard["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


# ---- Dockerfile -----------------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        joined.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln.strip() else "") for ln in joined]


def dockerignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.removeprefix("!").rstrip("/")
        if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, pat + "/*") or path.startswith(pat + "/"):
            ignored = not negate
    return ignored


def test_the_image_is_multi_stage_runs_as_a_non_root_user_and_installs_the_project() -> None:
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "USER", "EXPOSE", "ENTRYPOINT", "CMD", "LABEL"}
    instructions = dockerfile_instructions(REPO / "Dockerfile")
    assert {op for op, _ in instructions} <= known
    stages = [args.split()[-1] for op, args in instructions if op == "FROM" and " AS " in args.upper()]
    assert stages == ["builder", "runtime"]
    copies_from = [re.search(r"--from=(\S+)", args) for op, args in instructions if op == "COPY"]
    assert {m.group(1) for m in copies_from if m} == {"builder"}
    runtime = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM"):]
    users = [args for op, args in runtime if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    runs = " ".join(args for op, args in instructions if op == "RUN")
    assert "pip install ." in runs and "download.pytorch.org/whl/" in " ".join(a for _, a in instructions)
    assert ("ARG", "TORCH_VARIANT=cpu") in instructions


def test_everything_the_image_copies_exists_and_is_in_the_build_context() -> None:
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for op, args in dockerfile_instructions(REPO / "Dockerfile"):
        if op == "COPY" and "--from=" not in args:
            *sources, _dest = args.split()
            for source in sources:
                assert (REPO / source).exists(), source
                assert not dockerignored(source.rstrip("/"), patterns), f"{source} is excluded by .dockerignore"
    for private in (".env", ".venv", "data", "models", "tests"):
        assert dockerignored(private, patterns), f"{private} would be sent to the Docker daemon"


# ---- NATS -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nats.conf", "cluster-1.conf", "cluster-2.conf", "cluster-3.conf"])
def test_nats_configs_are_accepted_by_nats_server(name: str) -> None:
    conf = REPO / "deploy" / "nats" / name
    env = {**os.environ, **ROLE_PASSWORDS}
    out = subprocess.run([find_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    text = conf.read_text()
    assert re.search(r"^max_payload: 8MB$", text, re.M) and "jetstream {" in text


def test_the_three_cluster_nodes_differ_only_in_their_name_and_route_to_each_other() -> None:
    texts = [(REPO / "deploy" / "nats" / f"cluster-{i}.conf").read_text() for i in (1, 2, 3)]
    for i, text in enumerate(texts, start=1):
        assert re.search(rf"^server_name: nats-{i}$", text, re.M)
        assert sorted(re.findall(r"nats-route://(nats-\d)\.", text)) == ["nats-1", "nats-2", "nats-3"]
        assert "include permissions.conf" in text  # the role users; their secrets come from the environment
    normalized = {re.sub(r"nats-\d|cluster-\d|Node \d", "X", t) for t in texts}
    assert len(normalized) == 1


def test_a_cluster_node_refuses_to_start_without_its_passwords() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    out = subprocess.run([find_binary(), "-t", "-c", str(REPO / "deploy" / "nats" / "cluster-1.conf")],
                         capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode != 0 and "PASSWORD" in out.stderr


async def test_a_client_given_two_nats_urls_moves_to_the_other_node_when_its_node_stops(tmp_path: Path) -> None:
    """docs/deploy.md: ``NATS_URL`` may list several nodes, comma-separated; every service connects through
    ``services.common.bus.connect``, which hands the whole list to the client. Two real nats-servers; the
    client picks either (nats.py shuffles the list), so the one it is on is stopped, whichever that is."""
    async with EmbeddedNatsServer(tmp_path / "node-a") as node_a, EmbeddedNatsServer(tmp_path / "node-b") as node_b:
        nc = await connect(f"{node_a.url}, {node_b.url}", "two-urls")
        try:
            ports = {node_a.url.rsplit(":", 1)[1]: node_a, node_b.url.rsplit(":", 1)[1]: node_b}
            on = ports[str(nc.connected_url.port)]  # type: ignore[union-attr]
            other = node_b if on is node_a else node_a
            got: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_msg(msg: Msg) -> None:
                await got.put(msg.data)

            await nc.subscribe("llm.v1.test.failover", cb=on_msg)
            await nc.flush()
            await on.stop()
            async with asyncio.timeout(15):
                while not (nc.is_connected and str(nc.connected_url.port) == other.url.rsplit(":", 1)[1]):  # type: ignore[union-attr]
                    await asyncio.sleep(0.05)
                await nc.flush()  # the subscription is back on the surviving node
                direct = await connect(other.url, "publisher")
                try:
                    await direct.publish("llm.v1.test.failover", b"after the failover")
                    await direct.flush()
                    assert await got.get() == b"after the failover"
                finally:
                    await direct.close()
        finally:
            await nc.close()


# ---- systemd --------------------------------------------------------------------------------------------


def unit_exec_start(text: str) -> list[str]:
    joined = text.replace("\\\n", " ")
    line = next(ln for ln in joined.splitlines() if ln.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def verify_units(units: list[Path], tmp_path: Path) -> str:
    """systemd-analyze verify's complaints (it exits 0 on unknown keys, so any output is a failure).
    The binaries the units name are not installed here: they are pointed at stand-in executables."""
    analyze = tool("systemd-analyze")
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    copies = []
    for unit in units:
        text = unit.read_text()
        for binary in sorted(set(re.findall(r"(/\S+/bin/[\w.-]+)", text))):
            if not Path(binary).exists():
                stub = stubs / Path(binary).name
                stub.write_text("#!/bin/sh\n")
                stub.chmod(0o755)
                text = text.replace(binary, str(stub))
        copy = tmp_path / unit.name
        copy.write_text(text)
        copies.append(str(copy))
    out = subprocess.run([analyze, "verify", *copies], capture_output=True, text=True, timeout=60)
    return (out.stdout + out.stderr).strip() + ("" if out.returncode == 0 else f"\n(exit {out.returncode})")


def test_every_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    units = sorted(UNITS.glob("*.service"))
    assert {u.name for u in units} == {"ninfer-engine.service", "llmgw-gateway.service", "llmgw-telemetry.service",
                                       "llmgw-accounting.service", "nats-server.service"}
    assert verify_units(units, tmp_path) == ""


def test_verify_catches_a_misspelt_setting(tmp_path: Path) -> None:
    bad = tmp_path / "src" / "bad.service"
    bad.parent.mkdir()
    bad.write_text((UNITS / "llmgw-gateway.service").read_text().replace("Restart=on-failure", "Restart=sometimes"))
    assert "sometimes" in verify_units([bad], tmp_path)


def test_the_engine_unit_runs_the_runbook_command_line_with_restart_and_hardening() -> None:
    text = (UNITS / "ninfer-engine.service").read_text()
    argv = unit_exec_start(text)
    assert argv[0] == "/opt/ninfer/venv/bin/ninfer-serve" and argv[1:] == RUNBOOK[1:]
    engine_parser().parse_args(argv[1:])  # every runbook flag exists in ninfer-serve
    for setting in ("Restart=on-failure", "NoNewPrivileges=yes", "ProtectSystem=strict",
                    "ReadWritePaths=/var/lib/ninfer", "EnvironmentFile=-/etc/ninfer/engine.env", "User=ninfer"):
        assert re.search(rf"^{re.escape(setting)}$", text, re.M), setting
    # GPU device nodes must stay reachable: these settings would hide /dev/nvidia*
    for setting in ("PrivateDevices=yes", "ProtectClock=yes", "DevicePolicy=closed", "DevicePolicy=strict"):
        assert not re.search(rf"^{setting}$", text, re.M), setting


@pytest.mark.parametrize("name,role", [("llmgw-gateway.service", "gateway"), ("llmgw-telemetry.service", "telemetry"),
                                       ("llmgw-accounting.service", "accounting")])
def test_the_service_units_run_their_role_with_an_environment_file(name: str, role: str) -> None:
    text = (UNITS / name).read_text()
    argv = unit_exec_start(text)
    assert argv[:2] == ["/opt/llmgw/venv/bin/llmgw", role]
    module = __import__(f"services.{role}.__main__", fromlist=["add_arguments"])
    parser = argparse.ArgumentParser(exit_on_error=False)
    module.add_arguments(parser)
    parser.parse_args(argv[2:])
    assert "EnvironmentFile=/etc/llmgw/llmgw.env" in text and f"ReadWritePaths=/var/lib/llmgw/{role}" in text
    assert "Restart=on-failure" in text and "NoNewPrivileges=yes" in text


# ---- scripts --------------------------------------------------------------------------------------------


def test_scripts_pass_shellcheck() -> None:
    out = subprocess.run([tool("shellcheck"), *map(str, sorted((REPO / "scripts").glob("*.sh")))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def install(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """install-engine.sh into a temporary root, with this venv standing in for the one it would create."""
    return subprocess.run([str(INSTALL), "--venv", sys.prefix, "--no-pip", "--no-systemd",
                           "--user", subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip(),
                           "--state-dir", str(tmp_path / "var" / "ninfer"), "--unit-dir", str(tmp_path / "units"),
                           "--env-file", str(tmp_path / "etc" / "engine.env"), "--worker-id", "gpu7-engine", *args],
                          capture_output=True, text=True, timeout=120)


def test_install_engine_help_describes_every_option() -> None:
    out = subprocess.run([str(INSTALL), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    for option in ("--dry-run", "--source", "--model", "--nats", "--no-spec", "--worker-id", "--torch-variant"):
        assert option in out.stdout


def test_install_engine_dry_run_prints_the_plan_and_changes_nothing(tmp_path: Path) -> None:
    out = subprocess.run([str(INSTALL), "--dry-run", "--no-spec", "--prefix", str(tmp_path / "opt"),
                          "--state-dir", str(tmp_path / "state"), "--unit-dir", str(tmp_path / "units"),
                          "--env-file", str(tmp_path / "etc" / "engine.env"), "--nats", "nats://10.0.0.1:4222",
                          "--worker-id", "gpu7-engine"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.iterdir()) == []
    assert f"+ python3 -m venv {tmp_path / 'opt' / 'venv'}" in out.stdout
    assert "download.pytorch.org/whl/cu128" in out.stdout and "NATS_URL=nats://10.0.0.1:4222" in out.stdout
    assert "+ systemctl enable ninfer-engine.service" in out.stdout
    unit_text = "\n".join(ln.removeprefix("    | ") for ln in out.stdout.splitlines() if ln.startswith("    | "))
    exec_start = " ".join(unit_exec_start(unit_text))
    assert exec_start.startswith(f"{tmp_path / 'opt' / 'venv' / 'bin' / 'ninfer-serve'} {tmp_path / 'state'}/")
    assert "--spec" not in exec_start and "--worker-id gpu7-engine" in exec_start


def test_install_engine_writes_a_valid_unit_and_env_file_and_a_second_run_changes_nothing(tmp_path: Path) -> None:
    first = install(tmp_path, "--no-spec", "--nats", "nats://10.0.0.1:4222")
    assert first.returncode == 0, first.stdout + first.stderr
    unit = tmp_path / "units" / "ninfer-engine.service"
    env_file = tmp_path / "etc" / "engine.env"
    argv = unit_exec_start(unit.read_text())
    assert argv[0] == f"{sys.prefix}/bin/ninfer-serve"
    args = engine_parser().parse_args(argv[1:])
    state = tmp_path / "var" / "ninfer"
    assert args.model_path == f"{state}/qwen3_8_27b_nvfp4_v3.ninfer" and args.worker_id == "gpu7-engine"
    assert str(args.metrics_state) == f"{state}/metrics-state.json" and args.spec == "none"
    assert (args.max_context, args.max_concurrency, args.kv_dtype) == (262144, 8, "fp8")  # the runbook's
    assert "flags ninfer-serve will run with:" in first.stdout and "max-context              262144" in first.stdout
    assert "NATS_URL=nats://10.0.0.1:4222" in env_file.read_text() and env_file.stat().st_mode & 0o007 == 0
    assert state.is_dir() and f"ReadWritePaths={state}" in unit.read_text()
    (tmp_path / "verify").mkdir()
    assert verify_units([unit], tmp_path / "verify") == ""

    before = (unit.stat().st_mtime_ns, env_file.stat().st_mtime_ns)
    second = install(tmp_path, "--no-spec", "--nats", "nats://10.9.9.9:4222")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "unchanged" in second.stdout and "kept" in second.stdout
    assert (unit.stat().st_mtime_ns, env_file.stat().st_mtime_ns) == before
    assert "10.9.9.9" not in env_file.read_text()  # an existing env file (it holds secrets) is never rewritten


def test_install_engine_refuses_flags_the_engine_would_refuse_before_writing_anything(tmp_path: Path) -> None:
    out = install(tmp_path, "--flags", "--max-concurrency 0 --port 8006")
    assert out.returncode == 2
    assert "max-concurrency" in out.stderr and "must be >= 1" in out.stderr
    assert not (tmp_path / "units").exists() and not (tmp_path / "etc").exists()


def test_the_pools_example_names_the_compose_engines_as_bus_workers() -> None:
    pools = json.loads((REPO / "deploy" / "config" / "pools.example.json").read_text())["model_pools"]
    backends = {m["backend"] for pool in pools.values() for m in pool["members"]}
    services = resolved("gpu", "cpu")["services"]
    worker_ids = {next(a.split("=", 1)[1] for a in services[s]["command"] if a.startswith("--worker-id="))
                  for s in ("engine", "engine-cpu")}
    assert backends == {f"bus:{w}" for w in worker_ids} == {"bus:engine-gpu0", "bus:engine-cpu0"}
