"""The plugins this project ships under plugins/, what each provides and how to install it, so
`pdserve plugins` and an unknown-name error can say which one is missing and the command that
adds it. Only metadata is read: nothing here imports a plugin."""

from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class FirstParty:
    distribution: str
    provides: tuple[tuple[str, str], ...]  # (registry kind, name)
    extra: str = ""  # the extra a plain install should use (the SDK flavour), if any
    note: str = ""

    def installed(self) -> bool:
        try:
            md.distribution(self.distribution)
        except md.PackageNotFoundError:
            return False
        return True

    def checkout_dir(self) -> Path | None:
        """plugins/<distribution> of the checkout this pdcore runs from, if it is one."""
        path = Path(__file__).resolve().parents[2] / "plugins" / self.distribution
        return path if (path / "pyproject.toml").is_file() else None

    def install_command(self) -> str:
        """From the checkout when pdcore runs from one, else from the package index."""
        extra = f"[{self.extra}]" if self.extra else ""
        target = f"{self.distribution}{extra}"
        where = self.checkout_dir()
        if where is not None:
            rel = os.path.relpath(where)
            target = f"{where if rel.startswith('..') else './' + rel}{extra}"
        return f"pip install '{target}'" if extra else f"pip install {target}"

    def index_command(self) -> str:
        extra = f"[{self.extra}]" if self.extra else ""
        return f"pip install '{self.distribution}{extra}'" if extra else \
            f"pip install {self.distribution}"


MOONCAKE_POOLS = ("mooncake-nvlink", "mooncake-barex", "mooncake-intra-node-nvlink")

FIRST_PARTY: tuple[FirstParty, ...] = (
    FirstParty("pd-mooncake",
               (("transfer_backend", "mooncake"), *(("memory_pool", p) for p in MOONCAKE_POOLS)),
               extra="cuda", note="on a machine without CUDA use the [cpu] extra instead"),
    FirstParty("pd-nixl", (("transfer_backend", "nixl"),)),
    FirstParty("pd-ascend", (("transfer_backend", "ascend"), ("platform", "npu"),
                             ("memory_pool", "npu"))),
    FirstParty("pd-staging", (("transfer_planner", "staging"),)),
)


def missing() -> list[FirstParty]:
    """First-party plugins that are not installed in this environment."""
    return [p for p in FIRST_PARTY if not p.installed()]


def provider_hint(kind: str, name: str) -> str:
    """One sentence naming the uninstalled first-party plugin that provides `kind` `name`, with
    its install command; empty when no such plugin exists or it is installed."""
    for plugin in FIRST_PARTY:
        if (kind, name) in plugin.provides and not plugin.installed():
            note = f" ({plugin.note})" if plugin.note else ""
            return (f"{kind} {name!r} comes from the {plugin.distribution} plugin, which is not "
                    f"installed: {plugin.install_command()}{note}")
    return ""
