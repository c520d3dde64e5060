"""Plugin system: pluggy hookspecs, the plugin host, and the typed name registry."""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("pdcore")
hookspec = pluggy.HookspecMarker("pdcore")

__all__ = ["hookimpl", "hookspec"]
