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
exec nats-server -c /etc/nats/nats.conf "$@"
