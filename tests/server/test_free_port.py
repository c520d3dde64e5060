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
