#!/usr/bin/env bash
# Installs what is needed, then starts 1 prefill + 1 decode server and the router on SmolLM2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pdcore up "$@"
