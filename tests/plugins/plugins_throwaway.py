"""A throwaway third-party pdcore plugin distribution: build it, pip-install it, remove it.

Distribution `pdcore-throwaway-mypool` with `[project.entry-points.pdcore] mypool =
"mypool_plugin"`, registering memory pool `mypool` (torch memory under another name).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib import metadata
from pathlib import Path

THROWAWAY_DIST = "pdcore-throwaway-mypool"
THROWAWAY_VERSION = "0.3.1"
THROWAWAY_POOL = "mypool"
THROWAWAY_MODULE = "mypool_plugin"

PYPROJECT = f"""\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{THROWAWAY_DIST}"
version = "{THROWAWAY_VERSION}"
description = "throwaway pdcore plugin built by tests/plugins"
dependencies = ["pdcore"]

[project.entry-points.pdcore]
{THROWAWAY_POOL} = "{THROWAWAY_MODULE}"

[tool.setuptools]
py-modules = ["{THROWAWAY_MODULE}"]
"""

MODULE = f'''\
"""Throwaway pdcore plugin: memory pool `{THROWAWAY_POOL}` (torch memory under another name)."""

from __future__ import annotations

from pdcore.plugins import hookimpl


def make_pool(ctx):
    from pdcore.builtin.torch_pool import TorchMemoryPool  # imported only when chosen

    pool = TorchMemoryPool(ctx)
    pool.name = "{THROWAWAY_POOL}"
    return pool


@hookimpl
def pd_register_memory_pools(register):
    register("{THROWAWAY_POOL}", make_pool, description="throwaway test pool")
'''


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=300, check=False)


def installed() -> bool:
    try:
        metadata.distribution(THROWAWAY_DIST)
    except metadata.PackageNotFoundError:
        return False
    return True


def install(workdir: Path) -> None:
    """Write the project into `workdir` and pip-install it (no network, no build isolation)."""
    (workdir / "pyproject.toml").write_text(PYPROJECT)
    (workdir / f"{THROWAWAY_MODULE}.py").write_text(MODULE)
    if installed():  # left over by an interrupted run
        uninstall()
    r = pip("install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet", str(workdir))
    if r.returncode != 0:
        raise RuntimeError(f"pip install {THROWAWAY_DIST} failed:\n{r.stdout}\n{r.stderr}")
    importlib.invalidate_caches()


def uninstall() -> None:
    r = pip("uninstall", "-y", THROWAWAY_DIST)
    importlib.invalidate_caches()
    if r.returncode != 0:
        raise RuntimeError(f"pip uninstall {THROWAWAY_DIST} failed:\n{r.stdout}\n{r.stderr}")
