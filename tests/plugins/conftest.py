"""Fixtures for plugin tests.

`throwaway_pool_plugin` (session scope) builds a tiny third-party distribution in a temp dir
(`[project.entry-points.pdcore] mypool = "mypool_plugin"`, registering memory pool `mypool`),
pip-installs it into the running environment (--no-deps --no-build-isolation) and uninstalls it
afterwards. It yields the pool name, so an end-to-end test can run e.g.
`pdserve serve --memory-pool mypool` in a subprocess and see a third-party pool used.
"""

from __future__ import annotations

from collections.abc import Iterator

import plugins_throwaway
import pytest

from pdcore.plugins.host import reset_host


@pytest.fixture(scope="session")
def throwaway_pool_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    plugins_throwaway.install(tmp_path_factory.mktemp("throwaway_plugin"))
    reset_host()  # the process-wide host is rebuilt with the new plugin on next use
    try:
        yield plugins_throwaway.THROWAWAY_POOL
    finally:
        plugins_throwaway.uninstall()
        reset_host()


@pytest.fixture
def fresh_host() -> Iterator[None]:
    """The process-wide host is rebuilt before and after the test."""
    reset_host()
    yield
    reset_host()
