#!/usr/bin/env bash
# Runs a Python command as an AMD Zen 2 (EPYC Rome: AVX2 and FMA, no AVX-512, no AMX) would, on
# any x86_64 host: the interpreter runs under qemu-x86_64 -cpu EPYC-Rome, and so does every Python
# process it starts through sys.executable (servers, schedulers, pytest's children), so torch and
# oneDNN dispatch by that CPUID and an AVX-512 instruction anywhere dies of SIGILL (QEMU has
# none). qemu-user leaves /proc/cpuinfo as the host's, so PDCORE_CPUINFO gets a copy without the
# AVX-512 and AMX flags. Programs started by path (g++, shell scripts) run natively. About 5-10x
# slower than native: for correctness (which library loads, which tests skip, no SIGILL), never
# for timings.
#   scripts/emulate_zen2.sh PYTHON [ARGS...]
#   e.g. scripts/emulate_zen2.sh ~/.cache/pdserve/venv/bin/python -m pytest -p no:xdist \
#          tests/engine/test_native.py
# Needs qemu-user (scripts/setup.sh --apt installs it). A sitecustomize module of the
# environment's own is shadowed while this runs.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: scripts/emulate_zen2.sh PYTHON [ARGS...]" >&2; exit 2
fi
command -v qemu-x86_64 >/dev/null || { echo "qemu-x86_64 missing: apt-get install qemu-user" >&2; exit 2; }
py=$(command -v "$1") || { echo "no interpreter $1" >&2; exit 2; }
shift
work=$(mktemp -d "${TMPDIR:-/tmp}/emulate-zen2.XXXXXX")
trap 'rm -rf "$work"' EXIT
sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni[a-z0-9_]*)\b//g' /proc/cpuinfo \
  > "$work/cpuinfo"
cat > "$work/python" <<EOF
#!/usr/bin/env bash
# QEMU warns once per process about CPUID bits TCG lacks (rdseed, sha-ni, ...): not ours
exec qemu-x86_64 -cpu EPYC-Rome "$py" "\$@" 2> >(grep -v "TCG doesn't support" >&2)
EOF
chmod +x "$work/python"
cat > "$work/sitecustomize.py" <<EOF
import sys
sys.executable = "$work/python"  # children started through sys.executable run emulated too
EOF
export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}" PDCORE_CPUINFO="$work/cpuinfo"
unset PDCORE_CPU_ISA PDCORE_NATIVE_ISA
"$work/python" "$@"
