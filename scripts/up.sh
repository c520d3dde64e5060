#!/usr/bin/env bash
# Installs pdserve into its own virtual environment (scripts/setup.sh: from the declared
# metadata, reused while the sources are unchanged, with progress; `pdserve` linked into
# ~/.local/bin), then starts 1 prefill + 1 decode server and the router on SmolLM2. Extra
# arguments go to `pdserve up` (relative paths as from where you ran this). PDSERVE_VENV moves
# the environment (default ~/.cache/pdserve/venv).
set -euo pipefail
bash "$(dirname "$0")/setup.sh"
exec "${PDSERVE_VENV:-$HOME/.cache/pdserve/venv}/bin/pdserve" up "$@"
