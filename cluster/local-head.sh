#!/usr/bin/env bash
# Start a Ray head on loopback with token authentication, submit a recipe to it as a job,
# follow its logs, and stop the head afterwards.
#
#   cluster/local-head.sh [RECIPE] [KEY.PATH=VALUE ...]      (default: recipes/smoke/tiny.yaml)
#
# Every ray command here sees the same RAY_AUTH_MODE and token: Ray 2.60 refuses clients whose
# auth settings differ from the cluster's.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$PWD/.venv/bin"
RECIPE="${1:-recipes/smoke/tiny.yaml}"; shift || true

export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN="${RAY_AUTH_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}"
unset RAY_ADDRESS
DASHBOARD=8265

"$BIN/ray" start --head --node-ip-address 127.0.0.1 --dashboard-host 127.0.0.1 \
  --dashboard-port "$DASHBOARD" --include-dashboard true --disable-usage-stats
trap '"$BIN/ray" stop --force >/dev/null' EXIT

# The entrypoint runs with the head's PATH, so name the venv's k3post explicitly.
"$BIN/ray" job submit --address "http://127.0.0.1:$DASHBOARD" --working-dir . \
  --runtime-env-json '{"excludes": ["runs", ".venv", ".git"]}' \
  -- "$BIN/k3post" run "$RECIPE" --run-dir "$PWD/runs/job-$(basename "$RECIPE" .yaml)" "$@"
