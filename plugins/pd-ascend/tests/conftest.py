"""Fixtures for the pd-ascend tests (helpers live in ascend_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ascend_helpers import HAS_MEMFABRIC, running_store


@pytest.fixture(scope="session")
def mf_store() -> Iterator[str]:
    """One config store for the whole session (memfabric cannot stop a store in-process)."""
    if not HAS_MEMFABRIC:
        pytest.skip("memfabric-hybrid not installed")
    with running_store() as (url, _proc):
        yield url
