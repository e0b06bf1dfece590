#!/bin/sh
# The compose nats service's entrypoint: each role's bus password from .env (NATS_<ROLE>_PASSWORD) when set,
# else the one generated at the first start into the shared bus-secrets volume (mode 0600, owned by the
# services' uid), then nats-server with deploy/nats/nats.conf (which includes permissions.conf).
set -eu
dir=${LLMGW_BUS_SECRETS_DIR:-/run/llmgw-bus}
umask 077
for role in gateway engine telemetry accounting admin; do
  var="NATS_$(echo "$role" | tr '[:lower:]' '[:upper:]')_PASSWORD"
  eval "given=\${$var:-}"
  if [ -z "$given" ]; then
    if [ ! -s "$dir/$role" ]; then
      tr -dc 'A-Za-z0-9' < /dev/urandom | head -c 32 > "$dir/$role.tmp"
      mv "$dir/$role.tmp" "$dir/$role"
      echo "nats-start: generated the bus password of role $role (kept in the bus-secrets volume)"
    fi
    given=$(cat "$dir/$role")
  else
    printf '%s' "$given" > "$dir/$role.tmp" && mv "$dir/$role.tmp" "$dir/$role"
  fi
  export "$var=$given"
done
chown 10001 "$dir"/* 2>/dev/null || true  # the llmgw image's user reads its own role's file
# The engine user may use the subjects of this compose's engines only (their --worker-id: the gpu and cpu
# profiles' defaults, or LLMGW_ENGINE_WORKER_ID): the shipped permissions.conf with the engine user's
# wildcards (llm.v1.hb.*, llm.v1.gen.*, ...) replaced by those ids, next to a copy of nats.conf.
ids=${LLMGW_ENGINE_WORKER_ID:-engine-gpu0 engine-cpu0}
etc=${LLMGW_NATS_ETC:-/etc/nats}
conf=${LLMGW_NATS_CONF_DIR:-/tmp/llmgw-nats}
mkdir -p "$conf"
cp "$etc/nats.conf" "$conf/nats.conf"
awk -v ids="$ids" '
  BEGIN { n = split(ids, id, " ") }
  /user: "engine",/ { engine = 1; print; next }
  engine && /permissions:/ {
    line = $0
    while (match(line, /"[^"]*\.\*"/)) {
      subj = substr(line, RSTART + 1, RLENGTH - 3)   # "llm.v1.hb.*" -> llm.v1.hb.
      out = ""
      for (i = 1; i <= n; i++) out = out (i > 1 ? ", " : "") "\"" subj id[i] "\""
      printf "%s%s", substr(line, 1, RSTART - 1), out
      line = substr(line, RSTART + RLENGTH)
    }
    print line; engine = 0; next
  }
  { print }' "$etc/permissions.conf" > "$conf/permissions.conf"
exec nats-server -c "$conf/nats.conf" "$@"
