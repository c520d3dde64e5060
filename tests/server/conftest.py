"""Server-test fixtures (helpers in fake_server.py).

- `fake_server` (module): create_app() with the echo stand-in scheduler (fake_scheduler.py),
  context length 256, 4096 pages. `FakeServer.free_pages()` reads /get_load.
- `pages_back` (function): asserts the scheduler's free pages return to their start value.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fake_server, fake_scheduler

from fake_server import FakeServer, wait_pages
from pdserve_testing import TEST_ADMIN_KEY


@pytest.fixture(scope="module")
def fake_server(tiny_llama_dir: Path) -> Iterator[FakeServer]:
    server = FakeServer(tiny_llama_dir, context_length=256, admin_api_key=TEST_ADMIN_KEY)
    yield server
    server.stop()


@pytest.fixture
def pages_back(fake_server: FakeServer) -> Iterator[None]:
    start = fake_server.free_pages()
    yield
    assert wait_pages(fake_server, start) == start, "KV pages leaked by this test"
    assert fake_server.client.get("/health").status_code == 200
