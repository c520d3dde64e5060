"""PD mode: two requests on one bootstrap room, sent to P and D directly: the second on each
server is refused with 409 (issue 44 item 8: a client error, not a 500) and the room it names
goes on; both engines stay up, pages return to their baseline, and a later request through the
router succeeds. Real P + D + router, tiny model."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from pdcore.testing.processes import PDCluster

pytestmark = pytest.mark.timeout(400)
FLAGS = ("--max-total-tokens", "4096", "--page-size", "4", "--skip-server-warmup")
# a request that reaches a server after the violated room was already failed and forgotten
# there (a busy CI machine delays one thread that long) is a new room whose peer never comes:
# it fails at the bootstrap / waiting timeout, which must come before the client's 120 s
TIMEOUTS = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30"}


def test_duplicate_room_fails_alone(tiny_llama_dir: Path) -> None:
    cluster = PDCluster("tcp", model_path=str(tiny_llama_dir), flags=FLAGS,
                        env=TIMEOUTS).start(300)
    try:
        [p], [d] = cluster.prefills, cluster.decodes
        body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 8},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.bootstrap_ports[0],
                "bootstrap_room": 4242}
        answers: list[httpx.Response | Exception] = []

        def send(url: str) -> None:
            try:
                answers.append(httpx.post(url + "/generate", json=body, timeout=120))
            except httpx.HTTPError as e:
                answers.append(e)

        threads = [threading.Thread(target=send, args=(s.url,)) for s in (p, p, d, d)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
            assert not t.is_alive(), "a request on the violated room hung"
        assert all(isinstance(a, httpx.Response) for a in answers), answers
        failed = [a for a in answers if a.status_code != 200]
        assert failed and all(a.status_code >= 400 and a.text for a in failed)
        dup = [a for a in failed if "already in use" in a.text]
        assert dup and all(a.status_code == 409 for a in dup), [(a.status_code, a.text)
                                                                for a in failed]
        assert p.alive() and d.alive()
        cluster.wait_pages_free()
        ok = httpx.post(cluster.url + "/generate", json={
            "text": "Hello", "sampling_params": {"max_new_tokens": 8}}, timeout=120)
        assert ok.status_code == 200, ok.text
        cluster.wait_pages_free()
    finally:
        cluster.stop()
