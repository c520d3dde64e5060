"""Fixtures for plugin tests.

`throwaway_pool_plugin` (session scope) builds a tiny third-party distribution in a temp dir
(`[project.entry-points.pdcore] mypool = "mypool_plugin"`, registering memory pool `mypool`),
pip-installs it into the running environment (--no-deps --no-build-isolation) and uninstalls it
afterwards. It yields the pool name, so an end-to-end test can run e.g.
`pdserve serve --memory-pool mypool` in a subprocess and see a third-party pool used.
"""

from __future__ import annotations

import contextlib
import fcntl
import sys
from collections.abc import Iterator
from pathlib import Path

import plugins_throwaway
import pytest

from pdcore.plugins.host import reset_host


@contextlib.contextmanager
def _env_lock() -> Iterator[Path]:
    """An exclusive lock on this environment's throwaway-plugin user count (a file beside
    site-packages): pytest-xdist workers share the environment, and one worker's uninstall once
    pulled the package from under the other's test (their xdist groups do not keep them on one
    worker: pytest 9 computes a test id that pytest-xdist 3.8 can no longer suffix)."""
    count = Path(sys.prefix) / ".pdcore-throwaway-users"
    with open(count.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield count
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _users(count: Path) -> int:
    try:
        return int(count.read_text() or 0)
    except (OSError, ValueError):
        return 0


@pytest.fixture(scope="session")
def throwaway_pool_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _env_lock() as count:  # the first user installs, the last one uninstalls
        users = _users(count)
        if users == 0 or not plugins_throwaway.installed():
            plugins_throwaway.install(tmp_path_factory.mktemp("throwaway_plugin"))
        count.write_text(str(users + 1))
    reset_host()  # the process-wide host is rebuilt with the new plugin on next use
    try:
        yield plugins_throwaway.THROWAWAY_POOL
    finally:
        with _env_lock() as count:
            users = max(_users(count) - 1, 0)
            count.write_text(str(users))
            if users == 0:
                plugins_throwaway.uninstall()
        reset_host()


@pytest.fixture
def fresh_host() -> Iterator[None]:
    """The process-wide host is rebuilt before and after the test."""
    reset_host()
    yield
    reset_host()
