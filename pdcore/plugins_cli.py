"""`pdserve plugins`: every registered name, who provides it, and whether it runs here; then
the first-party plugins that are not installed, with the command that installs each.

Exit status: 0 when every plugin loaded; 1 when a plugin failed to load, a name is registered
twice, or PDCORE_PLUGINS / PDCORE_DISABLE_PLUGINS name a plugin that is not installed (the table
is printed either way). Also runnable as `python -m pdcore.plugins_cli [--json]`.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

import typer

from pdcore.plugins.first_party import missing
from pdcore.plugins.host import PluginHost, get_host
from pdcore.plugins.registry import Entry

COLUMNS = ("kind", "name", "plugin", "distribution", "version", "available", "reason")


def _entry_row(entry: Entry) -> dict[str, Any]:
    ok, reason = entry.available()
    return {
        "kind": entry.kind.value,
        "name": entry.name,
        "plugin": entry.plugin,
        "distribution": entry.distribution,
        "version": entry.version,
        "available": ok,
        "reason": reason,
        "description": entry.description,
    }


def collect(host: PluginHost) -> dict[str, Any]:
    """Everything `pdserve plugins` shows, as plain data (the --json document)."""
    entries, conflicts = [], []
    for registry in host.registries.values():
        entries.extend(_entry_row(e) for e in registry.entries())
        for name, owners in registry.conflicts().items():
            conflicts.append({
                "kind": registry.kind.value,
                "name": name,
                "owners": [{"plugin": e.plugin, "distribution": e.distribution,
                            "version": e.version} for e in owners],
            })
    return {
        "plugins": [
            {"name": p.name, "distribution": p.distribution, "version": p.version,
             "module": p.module}
            for p in host.plugins.values()
        ],
        "entries": entries,
        "conflicts": conflicts,
        "failures": [{"plugin": f.plugin, "distribution": f.distribution, "reason": f.reason}
                     for f in host.failures],
        "skipped": [{"plugin": n, "reason": host.skip_reasons.get(n, "")} for n in host.skipped],
        # first-party plugins (plugins/ of this project) absent from this environment
        "not_installed": [
            {"distribution": p.distribution,
             "provides": [f"{kind} {name}" for kind, name in p.provides],
             "install": p.install_command(), "how_to_install": p.how_to_install(),
             "note": p.note}
            for p in missing()
        ],
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        # the last column (reason) is free text: no padding after it
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)] + [r[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def render_text(data: dict[str, Any]) -> str:
    rows = [[c.upper() for c in COLUMNS]]
    for e in data["entries"]:
        rows.append([e["kind"], e["name"], e["plugin"], e["distribution"], e["version"] or "-",
                     "yes" if e["available"] else "no", e["reason"]])
    out = [_table(rows)]
    if data["conflicts"]:
        out.append("\nConflicts (unusable until one owner is removed or disabled):")
        for c in data["conflicts"]:
            owners = ", ".join(f"{o['distribution']} {o['version']} (plugin {o['plugin']})".strip()
                               for o in c["owners"])
            out.append(f"  {c['kind']} {c['name']}: {owners}")
    if data["failures"]:
        out.append("\nFailed plugins:")
        for f in data["failures"]:
            dist = f" ({f['distribution']})" if f["distribution"] else ""
            out.append(f"  {f['plugin']}{dist}: {f['reason']}")
    if data["skipped"]:
        out.append("\nSkipped plugins:")
        out.extend(f"  {s['plugin']}: {s['reason']}" for s in data["skipped"])
    if data["not_installed"]:
        out.append("\nNot installed (first-party plugins, not on any package index; install "
                   "from a checkout's plugins/ folder):")
        for m in data["not_installed"]:
            note = f"  ({m['note']})" if m["note"] else ""
            out.append(f"  {m['distribution']}: {', '.join(m['provides'])}\n"
                       f"    {m['how_to_install']}{note}")
    return "\n".join(out)


def plugins_command(json_out: bool = False, host: PluginHost | None = None,
                    stream: TextIO | None = None) -> int:
    """Print the plugin table (or JSON) and return the exit status."""
    host = get_host() if host is None else host
    stream = sys.stdout if stream is None else stream
    data = collect(host)
    if json_out:
        stream.write(json.dumps(data, indent=2) + "\n")
    else:
        stream.write(render_text(data) + "\n")
    return 1 if data["failures"] or data["conflicts"] else 0


def register_plugins_command(app: typer.Typer) -> None:
    """Add `plugins [--json]` to a typer app."""

    @app.command("plugins")
    def plugins(
        json_out: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    ) -> None:
        """List transfer backends, memory pools, platforms and planners from every plugin."""
        code = plugins_command(json_out)
        if code:
            raise typer.Exit(code)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    unknown = [a for a in args if a != "--json"]
    if unknown:
        sys.stderr.write(f"unknown argument(s) {' '.join(unknown)}; usage: plugins [--json]\n")
        return 2
    return plugins_command("--json" in args)


if __name__ == "__main__":
    raise SystemExit(main())
