#!/usr/bin/env bash
# Installs what is needed, then runs the core tests and each plugin's tests as its own matrix
# entry; prints one closing line with the totals. Extra arguments go to every pytest run.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test || exit 1
PY=${PYTHON:-python3}
out=$(mktemp -d)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} UCX_NET_DEVICES=lo UCX_MODULES=^ib MC_LOG_LEVEL=WARNING PYTHONUNBUFFERED=1
status=0
run() {  # name, then pytest arguments
  local name=$1; shift
  echo "=== matrix entry: $name"
  $PY -m pytest -q -p no:cacheprovider --durations=15 --junitxml="$out/$name.xml" "$@"
  local rc=$?
  # 5 = no tests collected (e.g. a plugin whose tests all need hardware): not a failure
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=1; echo "=== $name FAILED (exit $rc)"; fi
}
run core tests "$@"
for p in plugins/*/; do
  n=$(basename "$p")
  [ -d "$p/tests" ] && run "$n" "$p/tests" --rootdir="$p" "$@"
done
$PY - "$out" <<'PYEOF'
import glob, sys, xml.etree.ElementTree as ET
t = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for f in glob.glob(sys.argv[1] + "/*.xml"):
    for s in ET.parse(f).getroot().iter("testsuite"):
        for k in t:
            t[k] += int(s.get(k, 0))
failed = t["failures"] + t["errors"]
print(f"{t['tests'] - failed - t['skipped']} passed, {failed} failed, {t['skipped']} skipped")
PYEOF
exit $status
