"""The plugins this project ships under plugins/, what each provides and how to install it, so
`pdserve plugins` and an unknown-name error can say which one is missing and the command that
adds it: from a checkout's plugins/ folder (they are on no package index), with the pip of this
environment. Only metadata is read: nothing here imports a plugin."""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
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
        """plugins/<distribution> of a pdserve checkout: the one this pdcore runs from (an
        editable install), else the one scripts/setup.sh installed this environment from (it
        records it in CHECKOUT_FILE), else the current folder if it is one."""
        for root in checkout_roots():
            path = root / "plugins" / self.distribution
            if (path / "pyproject.toml").is_file():
                return path
        return None

    def install_command(self) -> str:
        """The command that installs this plugin into this environment, from a checkout's
        plugins/ folder; '' when no checkout is known (the plugins are on no package index)."""
        where = self.checkout_dir()
        if where is None:
            return ""
        extra = f"[{self.extra}]" if self.extra else ""
        rel = os.path.relpath(where)
        target = f"{where if rel.startswith('..') else './' + rel}{extra}"
        return f"{pip_command()} install '{target}'" if extra else \
            f"{pip_command()} install {target}"

    def how_to_install(self) -> str:
        """install_command(), or how to get the plugin where no checkout is known."""
        return self.install_command() or (
            f"{self.distribution} is not published on any package index: get a pdserve "
            f"checkout (git clone) and run {pip_command()} install "
            f"CHECKOUT/plugins/{self.distribution}"
            + (f"[{self.extra}]" if self.extra else "")
            + f" (or write its path into {Path(sys.prefix) / CHECKOUT_FILE})")


# scripts/setup.sh writes the checkout's absolute path into this file of the environment it
# builds (it installs pdcore from a temporary copy, so the package cannot find its checkout)
CHECKOUT_FILE = "pdserve-checkout"


def checkout_roots() -> list[Path]:
    """Candidate checkout roots, best first (see FirstParty.checkout_dir)."""
    roots = [Path(__file__).resolve().parents[2]]
    try:
        recorded = (Path(sys.prefix) / CHECKOUT_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        recorded = ""
    if recorded:
        roots.append(Path(recorded))
    roots.append(Path.cwd())
    return roots


def pip_command() -> str:
    """pip of the environment pdserve runs in: `pip` alone may be another Python's."""
    in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
    return f"{sys.executable} -m pip" if in_venv else "pip"


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
                    f"installed: {plugin.how_to_install()}{note}")
    return ""
