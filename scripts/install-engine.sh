#!/usr/bin/env bash
# Install ninfer-serve as a systemd service on a GPU host. Idempotent: run it again after an upgrade or
# to change flags; what is already in place is kept (the env file is never overwritten).
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/install-engine.sh [options]

Installs the engine (ninfer-serve) into a venv, creates the service user and state directory, writes
the systemd unit ninfer-engine.service from deploy/systemd/ninfer-engine.service (the runbook command
line), checks the flags with the installed ninfer-serve, and prints them to confirm.

Options:
  --source PATH        project directory or wheel to install (default: this checkout)
  --prefix DIR         install prefix; the venv is DIR/venv (default: /opt/ninfer)
  --venv DIR           use this venv instead of PREFIX/venv (created when missing)
  --torch-variant V    torch wheel index on download.pytorch.org: cu128, cu126, cpu ... (default: cu128)
  --no-pip             do not install packages (the venv already holds the project)
  --model PATH         checkpoint directory or .ninfer file
                       (default: STATE_DIR/qwen3_8_27b_nvfp4_v3.ninfer, as in the runbook)
  --model-id ID        name clients use (default: qwen3.8-27b)
  --worker-id ID       bus worker id, stable across restarts (default: ninfer-<short hostname>)
  --flags "..."        engine flags replacing the runbook's (everything after MODEL except --model-id
                       and --worker-id)
  --no-spec            drop --spec/--draft-tokens/--lm-head-draft (for a checkpoint without MTP weights)
  --nats URL           NATS_URL for a new env file (joins the bus); an existing env file is kept
  --user NAME          service user (default: ninfer; created as a system user when missing)
  --state-dir DIR      state directory, the user's home (default: /var/lib/ninfer)
  --env-file FILE      EnvironmentFile of the unit (default: /etc/ninfer/engine.env)
  --unit-dir DIR       where the unit goes (default: /etc/systemd/system)
  --no-systemd         do not call systemctl (containers, image builds, tests)
  --start              (re)start the service after installing (default: enable only)
  --dry-run            print what would be done, change nothing
  -h, --help           this text
EOF
}

die() { echo "install-engine: $*" >&2; exit 2; }

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$SCRIPT_DIR/.." && pwd)"
TEMPLATE="$REPO_DIR/deploy/systemd/ninfer-engine.service"

SOURCE="$REPO_DIR"
PREFIX=/opt/ninfer
VENV=""
TORCH_VARIANT=cu128
DO_PIP=1
MODEL=""
MODEL_ID=qwen3.8-27b
WORKER_ID="ninfer-$(hostname -s 2>/dev/null || hostname)"
FLAGS=""
NO_SPEC=0
NATS_URL_ARG=""
SERVICE_USER=ninfer
STATE_DIR=/var/lib/ninfer
ENV_FILE=/etc/ninfer/engine.env
UNIT_DIR=/etc/systemd/system
USE_SYSTEMD=1
DO_START=0
DRY_RUN=0

need() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --source) need "$@"; SOURCE="$2"; shift 2 ;;
    --prefix) need "$@"; PREFIX="$2"; shift 2 ;;
    --venv) need "$@"; VENV="$2"; shift 2 ;;
    --torch-variant) need "$@"; TORCH_VARIANT="$2"; shift 2 ;;
    --no-pip) DO_PIP=0; shift ;;
    --model) need "$@"; MODEL="$2"; shift 2 ;;
    --model-id) need "$@"; MODEL_ID="$2"; shift 2 ;;
    --worker-id) need "$@"; WORKER_ID="$2"; shift 2 ;;
    --flags) need "$@"; FLAGS="$2"; shift 2 ;;
    --no-spec) NO_SPEC=1; shift ;;
    --nats) need "$@"; NATS_URL_ARG="$2"; shift 2 ;;
    --user) need "$@"; SERVICE_USER="$2"; shift 2 ;;
    --state-dir) need "$@"; STATE_DIR="$2"; shift 2 ;;
    --env-file) need "$@"; ENV_FILE="$2"; shift 2 ;;
    --unit-dir) need "$@"; UNIT_DIR="$2"; shift 2 ;;
    --no-systemd) USE_SYSTEMD=0; shift ;;
    --start) DO_START=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
  esac
done
VENV="$(realpath -m "${VENV:-$PREFIX/venv}")"  # systemd wants absolute paths
STATE_DIR="${STATE_DIR%/}"
MODEL="${MODEL:-$STATE_DIR/qwen3_8_27b_nvfp4_v3.ninfer}"
UNIT="$UNIT_DIR/ninfer-engine.service"
[[ -f "$TEMPLATE" ]] || die "unit template missing: $TEMPLATE"
[[ "$WORKER_ID" =~ ^[A-Za-z0-9_-]+$ ]] || die "--worker-id must be letters, digits, '-' or '_': $WORKER_ID"

PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (Python >= 3.11 is required)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "$PYTHON is older than 3.11"
if [[ $DRY_RUN -eq 0 && $EUID -ne 0 && $USE_SYSTEMD -eq 1 ]]; then
  die "run as root (or with --dry-run / --no-systemd)"
fi

# run CMD...: print it; run it unless --dry-run.
run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  [[ $DRY_RUN -eq 1 ]] || "$@"
}

# Engine flags: the runbook's (from the unit template), or --flags; --no-spec drops speculative decoding.
if [[ -z "$FLAGS" ]]; then
  FLAGS="$("$PYTHON" - "$TEMPLATE" "$STATE_DIR" <<'EOF'
import shlex, sys
text = open(sys.argv[1]).read().replace("\\\n", " ")
line = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
words = shlex.split(line.removeprefix("ExecStart="))[2:]  # drop the binary and the model path
out, skip = [], False
for i, w in enumerate(words):
    if skip:
        skip = False
        continue
    if w in ("--model-id", "--worker-id"):
        skip = True
        continue
    out.append(w.replace("/var/lib/ninfer", sys.argv[2]))  # --metrics-state follows --state-dir
print(shlex.join(out))
EOF
)"
fi
if [[ $NO_SPEC -eq 1 ]]; then
  FLAGS="$("$PYTHON" -c '
import shlex, sys
words, out, i = shlex.split(sys.argv[1]), [], 0
while i < len(words):
    w = words[i]
    if w in ("--spec", "--draft-tokens"):
        i += 2
        continue
    if w == "--lm-head-draft" or w.startswith(("--spec=", "--draft-tokens=")):
        i += 1
        continue
    out.append(w)
    i += 1
print(shlex.join(out))' "$FLAGS")"
fi
FLAG_WORDS=()
while IFS= read -r -d '' word; do FLAG_WORDS+=("$word"); done < <(
  "$PYTHON" -c 'import shlex, sys; sys.stdout.write("".join(w + "\0" for w in shlex.split(sys.argv[1])))' "$FLAGS")
ARGS=("$MODEL" --model-id "$MODEL_ID" "${FLAG_WORDS[@]}" --worker-id "$WORKER_ID")

# The unit: the template with this host's paths, user and command line.
render_unit() {
  "$PYTHON" - "$TEMPLATE" "$VENV/bin/ninfer-serve" "$STATE_DIR" "$SERVICE_USER" "$ENV_FILE" "${ARGS[@]}" <<'EOF'
import re, sys
template, binary, state, user, env_file, *args = sys.argv[1:]

def word(w: str) -> str:
    w = w.replace("%", "%%").replace("$", "$$")  # systemd specifiers and variables stay literal
    return f'"{w}"' if re.search(r'[\s"\'\\;]', w) or w == "" else w

lines, out, skipping = open(template).read().splitlines(), [], False
for ln in lines:
    if skipping:
        skipping = ln.endswith("\\")
        continue
    if ln.startswith("ExecStart="):
        skipping = ln.endswith("\\")
        words, parts, cur = [binary, *args], [], ""
        for w in map(word, words):
            if cur and w.startswith("--") and len(cur) + len(w) > 90:
                parts.append(cur)
                cur = "  " + w
            else:
                cur = f"{cur} {w}" if cur else f"ExecStart={w}"
        out.append(" \\\n".join([*parts, cur]))
        continue
    ln = re.sub(r"^(User|Group)=.*", lambda m: f"{m.group(1)}={user}", ln)
    ln = re.sub(r"^EnvironmentFile=.*", f"EnvironmentFile=-{env_file}", ln)
    if ln.startswith("StateDirectory"):  # systemd creates it only under /var/lib; elsewhere install -d does
        if not state.startswith("/var/lib/"):
            continue
        if ln.startswith("StateDirectory="):
            ln = "StateDirectory=" + state.removeprefix("/var/lib/")
    elif not ln.startswith("#"):
        ln = ln.replace("/var/lib/ninfer", state)
    out.append(ln)
print("\n".join(out))
EOF
}

echo "== ninfer-serve on $(hostname): venv $VENV, unit $UNIT, state $STATE_DIR, user $SERVICE_USER"
[[ $DRY_RUN -eq 1 ]] && echo "   (dry run: nothing is changed)"

# 1. The service user and its state directory.
if id -u "$SERVICE_USER" >/dev/null 2>&1; then
  echo "user $SERVICE_USER exists"
else
  run useradd --system --user-group --home-dir "$STATE_DIR" --shell /usr/sbin/nologin "$SERVICE_USER"
fi
run install -d -m 0750 -o "$SERVICE_USER" -g "$(id -gn "$SERVICE_USER" 2>/dev/null || echo "$SERVICE_USER")" "$STATE_DIR"

# 2. The venv and the project (torch first, from the variant's index: PyPI's torch is one fixed build).
if [[ -x "$VENV/bin/python" ]]; then
  echo "venv $VENV exists"
else
  run "$PYTHON" -m venv "$VENV"
fi
if [[ $DO_PIP -eq 1 ]]; then
  if [[ -d "$SOURCE" ]]; then
    [[ -f "$SOURCE/pyproject.toml" ]] || die "--source $SOURCE has no pyproject.toml"
    TORCH_PIN="$("$PYTHON" -c 'import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print(next(d for d in deps if re.match(r"torch\b", d)).split(";")[0].strip())' "$SOURCE/pyproject.toml")"
  elif [[ -f "$SOURCE" && "$SOURCE" == *.whl ]]; then
    TORCH_PIN="$("$PYTHON" -c 'import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
print(next(m.group(1).split(";")[0].strip() for m in re.finditer(r"^Requires-Dist: (torch\b.*)$", meta, re.M)))' "$SOURCE")"
  else
    die "--source must be a project directory or a .whl: $SOURCE"
  fi
  run "$VENV/bin/pip" install --quiet --upgrade pip
  run "$VENV/bin/pip" install --quiet --index-url "https://download.pytorch.org/whl/$TORCH_VARIANT" "$TORCH_PIN"
  run "$VENV/bin/pip" install --quiet "$SOURCE"
fi

# 3. Check the command line with the installed ninfer-serve's own parser, and print it to confirm.
CHECK='
import argparse, sys
from services.engine.__main__ import add_arguments
parser = argparse.ArgumentParser(prog="ninfer-serve")
add_arguments(parser)
args = parser.parse_args(sys.argv[1:])
# The engine start-up checks, minus loading the model (a non-file path is never opened here).
from services.common.runtime import ConfigError
from services.engine.__main__ import build_config
try:
    build_config(argparse.Namespace(**{**vars(args), "model_path": "/nonexistent/model-dir"}))
except ConfigError as exc:
    sys.exit(f"ninfer-serve would refuse to start: {exc}")
print("flags ninfer-serve will run with:")
for key, value in vars(args).items():
    if value is not None and value is not False:
        print(f"  {key.replace(chr(95), chr(45)):24} {value}")
'
if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import services.engine' 2>/dev/null; then
  "$VENV/bin/python" -c "$CHECK" "${ARGS[@]}" || die "fix the flags (--flags, --no-spec) and run again"
else
  echo "would check the flags with: $VENV/bin/python -c <argparse check> ${ARGS[*]}"
fi
[[ -e "$MODEL" ]] || echo "warning: the model $MODEL does not exist yet: copy it there before starting"

# 4. The env file: created once, never overwritten (it holds the NATS password and API keys).
if [[ -f "$ENV_FILE" ]]; then
  echo "env file $ENV_FILE exists: kept"
  [[ -z "$NATS_URL_ARG" ]] || echo "   note: --nats ignored; edit NATS_URL in $ENV_FILE yourself"
else
  NATS_LINE="# NATS_URL=nats://engine:<password>@nats-1.llmgw.internal:4222"
  [[ -z "$NATS_URL_ARG" ]] || NATS_LINE="NATS_URL=$NATS_URL_ARG"
  ENV_TEXT="# ninfer-engine.service environment (mode 0640). Secrets go here, not in the unit.
# Join the bus as a worker (pools name it bus:$WORKER_ID); unset: HTTP only.
$NATS_LINE
# Require this bearer key on the engine's HTTP API (/v1/*):
# NINFER_API_KEY=<engine-api-key>
# Which GPU this engine uses (one engine per GPU: copy the unit as ninfer-engine@N):
# CUDA_VISIBLE_DEVICES=0
LLMGW_LOG_LEVEL=INFO
"
  run install -d -m 0755 "$(dirname "$ENV_FILE")"
  echo "+ write $ENV_FILE"
  if [[ $DRY_RUN -eq 0 ]]; then
    (umask 027; printf '%s' "$ENV_TEXT" >"$ENV_FILE")
    chgrp "$(id -gn "$SERVICE_USER")" "$ENV_FILE" 2>/dev/null || true
  else
    printf '%s' "$ENV_TEXT" | sed 's/^/    | /'
  fi
fi

# 5. The unit: written only when it changes.
NEW_UNIT="$(render_unit)"
if [[ -f "$UNIT" ]] && [[ "$(cat "$UNIT")" == "$NEW_UNIT" ]]; then
  echo "unit $UNIT unchanged"
  UNIT_CHANGED=0
else
  echo "+ write $UNIT"
  if [[ $DRY_RUN -eq 0 ]]; then
    mkdir -p "$UNIT_DIR"
    printf '%s\n' "$NEW_UNIT" >"$UNIT.tmp" && mv "$UNIT.tmp" "$UNIT"
  else
    printf '%s\n' "$NEW_UNIT" | sed 's/^/    | /'
  fi
  UNIT_CHANGED=1
fi

# 6. systemd.
if [[ $USE_SYSTEMD -eq 1 ]]; then
  [[ $UNIT_CHANGED -eq 0 ]] || run systemctl daemon-reload
  run systemctl enable ninfer-engine.service
  if [[ $DO_START -eq 1 ]]; then
    run systemctl restart ninfer-engine.service
  fi
fi
cat <<EOF
== done. Start and watch it:
   systemctl start ninfer-engine && journalctl -u ninfer-engine -f
   (the start-up log prints the free-memory line and the KV capacity it chose; then
    curl -s http://127.0.0.1:8006/health and /slots)
   Pool it from a gateway as "backend": "http://$(hostname -f 2>/dev/null || hostname):8006" or, on the bus, "bus:$WORKER_ID".
EOF
