"""The README's five-minute tour, run as written: its bash blocks, taken from the README itself
(so the two cannot drift), run as one bash script against real servers on loopback. Only
three things differ from a user's shell: `pdserve` on PATH is a stand-in that serves the tiny
random model with a small KV pool and no warm-up (instead of SmolLM2), the tour's ports are
swapped for free ones, and HOME is empty. Every curl's answer is checked: the PD chat, the JSON schema, the
NGRAM server's /generate and the forced tool call. Also: every relative link of the README and
of docs/ names a file that exists."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pdserve_testing import REPO_ROOT, free_port

from pdcore.engine import native

README = REPO_ROOT / "README.md"
pytestmark = [pytest.mark.timeout(400),
              pytest.mark.skipif(not README.is_file(), reason="not a checkout")]
MARK = "@@@ curl"

SHIM = """#!/bin/sh
if [ "$1" = serve ]; then
  shift
  exec "{py}" -m pdcore serve --model-path "{model}" --max-total-tokens 4096 \\
    --skip-server-warmup "$@"
fi
exec "{py}" -m pdcore "$@"
"""


def tour_script() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Five-minute tour\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) >= 3, "the tour lost its code blocks"
    return "\n".join(blocks)


def _with_free_ports(script: str) -> str:
    ports = set(re.findall(r"(?:--port|--disaggregation-bootstrap-port) (\d+)", script))
    ports |= set(re.findall(r"127\.0\.0\.1:(\d+)", script))
    ports |= set(re.findall(r"--prefill \S+ (\d+)", script))
    for port in sorted(ports):
        script = re.sub(rf"\b{port}\b", str(free_port()), script)
    return script


def _answers(stdout: str) -> list[Any]:
    """The JSON answer of each curl, in order (the script echoes MARK before each curl)."""
    out = []
    for chunk in stdout.split(MARK + "\n")[1:]:
        out.append(json.JSONDecoder().raw_decode(chunk.lstrip())[0])
    return out


def test_the_readme_tour_runs_as_written(tiny_llama_dir: Path, tmp_path: Path) -> None:
    script = _with_free_ports(tour_script())
    # a marker before each curl that prints (not the readiness loops, whose output is dropped)
    script = re.sub(r"^curl ", f"echo '{MARK}'\ncurl ", script, flags=re.M)
    bin_dir, home, work = tmp_path / "bin", tmp_path / "home", tmp_path / "work"
    for d in (bin_dir, home, work):
        d.mkdir()
    shim = bin_dir / "pdserve"
    shim.write_text(SHIM.format(py=sys.executable, model=tiny_llama_dir))
    shim.chmod(0o755)
    env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           # the machine's caches (the native library, converted models) despite the new HOME
           native.DIR_ENV: str(native._cache_dir()),
           "PDCORE_CACHE_DIR": str(Path.home() / ".cache" / "pdserve"),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if (REPO_ROOT / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                          env.get("PYTHONPATH")]))
    (work / "tour.sh").write_text(script)
    proc = subprocess.Popen(["bash", "-e", "tour.sh"], cwd=str(work), env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the tour left running
        except ProcessLookupError:
            pass
        proc.wait(10)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in work.glob("*.log"))
    assert proc.returncode == 0, f"{stdout}\n{stderr}\n{logs}"
    assert "pd-staging" in stdout or "transfer_backend" in stdout  # `pdserve plugins`' table
    chat, structured, generate, tools = _answers(stdout)
    assert "choices" in chat, chat
    message = chat["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"], chat
    content = structured["choices"][0]["message"]["content"]
    assert content.lstrip().startswith("{"), structured
    if structured["choices"][0]["finish_reason"] == "stop":  # complete: it follows the schema
        assert set(json.loads(content)) == {"city", "country"}, content
    assert generate["text"] and "spec_verify_ct" in generate["meta_info"], generate
    assert tools["choices"][0]["message"].get("tool_calls"), tools
    call = tools["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and "city" in json.loads(call["arguments"]), tools
    assert tools["choices"][0]["finish_reason"] == "tool_calls"
    assert "Traceback" not in logs, logs  # `kill` stops the servers cleanly


def test_readme_and_docs_links_name_files_that_exist() -> None:
    pages = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text("utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(REPO_ROOT)} -> {target}")
    assert not missing, missing
