"""free_port(), which every end-to-end test uses to place its servers."""

from __future__ import annotations

import socket

from pdcore.testing.ports import LOWEST_PORT, _ephemeral_low, free_port


def test_ports_are_bindable_distinct_and_below_the_ephemeral_range() -> None:
    """Outgoing connections take their local ports from the ephemeral range; a port picked
    there could be taken between free_port() and the server's bind."""
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if _ephemeral_low() > LOWEST_PORT + 1000:  # else there is no room below it
        assert all(LOWEST_PORT <= p < _ephemeral_low() for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_claimed_ports_are_not_handed_to_another_process(tmp_path, monkeypatch) -> None:
    """Two test processes (xdist workers, CI entries side by side) never get the same port:
    each port handed out is claimed in a directory they share, until its claimer exits."""
    import subprocess
    import sys

    monkeypatch.setenv("PDSERVE_PORT_DIR", str(tmp_path))
    mine = {free_port() for _ in range(30)}
    code = ("from pdcore.testing.ports import free_port; "
            "print(' '.join(str(free_port()) for _ in range(300)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    theirs = {int(p) for p in out.stdout.split()}
    assert len(theirs) == 300 and not mine & theirs
    # the other process is gone: its claims are stale and may be handed out again
    base = free_port(offsets=(0, 100))
    assert {base, base + 100}.isdisjoint(mine)
