#!/bin/sh
# Entrypoint of the compose llmgw services: `with-bus-user ROLE ARGS...` joins the bus as ROLE (its password
# from .env's NATS_<ROLE>_PASSWORD, else the one nats-start.sh generated into the bus-secrets volume) and
# runs `llmgw ARGS...`. A NATS_URL set in .env (a cluster elsewhere) is used as it is.
set -eu
role=$1
shift
if [ -z "${NATS_URL:-}" ]; then
  var="NATS_$(echo "$role" | tr '[:lower:]' '[:upper:]')_PASSWORD"
  eval "password=\${$var:-}"
  if [ -z "$password" ]; then
    password=$(cat "${LLMGW_BUS_SECRETS_DIR:-/run/llmgw-bus}/$role")
  fi
  NATS_URL="nats://$role:$password@${LLMGW_NATS_HOST:-nats:4222}"
  export NATS_URL
fi
exec llmgw "$@"
