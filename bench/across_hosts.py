"""Issue #31's acceptance across every host the benches ran on, read back from their results.

Every bench/results/vs_vllm*.json (pdserve against vLLM) and tpot_floor*.json (TPOT over the
weight-streaming floor) becomes rows keyed by (CPU, ISA cap, model, shape, measure); where a key
was measured more than once the newest result stands and the older ones are counted. A result
that does not name its CPU is left out (and listed): a ratio means nothing without the CPU it was
measured on. The measures #31 asks of each host seen (uncapped and capped to AVX2) that no result
holds are listed as not measured. The cap comes from the result's recorded variables
(machine.isa_caps, config.cap_isa) or, in results written before those were recorded, from its
name (`cap_avx2`, `avx2cap`).

Run: `python bench/across_hosts.py [--results DIR] [--out-dir DIR]`: prints a markdown table and
writes across_hosts.json + .png (bars: how far each row is from its target; right of 1 is met).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, figure, save_figure

NAME = "across_hosts"
TPOT_FLOOR_TARGET = 1.6  # #31: TPOT at batch 8 <= 1.6x the weight-streaming floor


def host_of(machine: dict[str, Any]) -> str | None:
    cpu = (machine.get("cpu") or "").strip()
    if not cpu:
        return None
    flags = set(machine.get("cpu_flags") or ())
    kind = "AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    return f"{cpu} ({kind})"


def cap_of(data: dict[str, Any]) -> str:
    caps = (data.get("machine") or {}).get("isa_caps") or {}
    config = data.get("config")
    if not isinstance(config, dict):
        config = {}
    cap = caps.get("PDCORE_CPU_ISA") or config.get("cap_isa")
    if cap:
        return str(cap)
    name = str(data.get("name", ""))
    return "avx2" if "cap_avx2" in name or "avx2cap" in name else "-"


def model_of(config: dict[str, Any]) -> str:
    path = str(config.get("model_path") or config.get("make_model") or "")
    return "Llama-1B-shaped" if config.get("make_1b") or "1b" in path.lower() else "SmolLM2-135M"


def rows_of(data: dict[str, Any], file: str) -> list[dict[str, Any]]:
    """One row per measure of one result file."""
    config = data.get("config") or {}
    if not isinstance(config, dict):  # a config written as text: the model from its words
        config = {"model_path": "1b" if "1b" in str(config).lower() else ""}
    base = {"host": host_of(data.get("machine") or {}), "cap": cap_of(data),
            "model": model_of(config), "time": (data.get("machine") or {}).get("time", ""),
            "file": file}
    rows = []
    if file.startswith("vs_vllm"):
        shape = f"{config.get('input_len')}/{config.get('output_len')} c{config.get('concurrency')}"
        for measure, acc in (data.get("acceptance") or {}).items():
            if not isinstance(acc, dict) or acc.get("ratio") is None:
                continue
            le = "tpot" in measure  # TPOT ratios are met at or below their target
            rows.append({**base, "shape": shape, "measure": measure, "ratio": acc["ratio"],
                         "target": acc.get("target"), "le": le,
                         "met": bool(acc.get("met")),
                         "pdserve": acc.get("pdserve"), "vllm": acc.get("vllm")})
    elif file.startswith("tpot_floor"):
        over = data.get("tpot_over_floor") or {}
        if isinstance(over, dict) and over.get("batch8") is not None:
            r = float(over["batch8"])
            rows.append({**base, "shape": "batch 8", "measure": "tpot_over_floor", "ratio": r,
                         "target": TPOT_FLOOR_TARGET, "le": True,
                         "met": r <= TPOT_FLOOR_TARGET})
    return rows


# what #31 asks of every host, uncapped and capped to AVX2: (model, shape, measure); the 1B model
# uncapped only
EXPECTED = [("SmolLM2-135M", "128/64 c8", m)
            for m in ("unified_f32_tok_s", "unified_f32_tpot", "1p1d_f32_tok_s")] + \
    [("SmolLM2-135M", "512/128 c4", m) for m in ("unified_f32_tok_s", "unified_f32_tpot")] + \
    [("SmolLM2-135M", "batch 8", "tpot_over_floor")]
EXPECTED_UNCAPPED = [("Llama-1B-shaped", "128/64 c8", "unified_f32_tok_s")]


def missing(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The measures #31 asks for that no result holds, per host and cap seen."""
    have = {(r["host"], r["cap"], r["model"], r["shape"], r["measure"]) for r in rows}
    out = []
    for host in sorted({r["host"] for r in rows}):
        for cap in ("-", "avx2"):
            for model, shape, measure in EXPECTED + (EXPECTED_UNCAPPED if cap == "-" else []):
                if (host, cap, model, shape, measure) not in have:
                    out.append({"host": host, "cap": cap, "model": model, "shape": shape,
                                "measure": measure})
    return out


def collect(results: Path) -> dict[str, Any]:
    newest: dict[tuple, dict[str, Any]] = {}
    older: dict[tuple, int] = {}
    skipped = []
    files = sorted(results.glob("vs_vllm*.json")) + sorted(results.glob("tpot_floor*.json"))
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            skipped.append({"file": path.name, "why": f"unreadable: {e}"})
            continue
        for row in rows_of(data, path.name):
            if row["host"] is None:
                skipped.append({"file": path.name, "why": "no CPU recorded"})
                break
            key = (row["host"], row["cap"], row["model"], row["shape"], row["measure"])
            if key in newest:
                older[key] = older.get(key, 0) + 1
                if row["time"] <= newest[key]["time"]:
                    continue
            newest[key] = row
    rows = sorted(newest.values(), key=lambda r: (r["host"], r["cap"], r["model"], r["shape"],
                                                  r["measure"]))
    for r in rows:
        r["older_results"] = older.get((r["host"], r["cap"], r["model"], r["shape"],
                                        r["measure"]), 0)
    return {"name": NAME, "results_dir": str(results), "rows": rows, "skipped": skipped,
            "all_met": all(r["met"] for r in rows), "not_measured": missing(rows)}


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| host | cap | model | shape | measure | ratio | target | met | file |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        target = f"{'<=' if r['le'] else '>='} {r['target']}" if r["target"] is not None else ""
        out.append(f"| {r['host']} | {r['cap']} | {r['model']} | {r['shape']} | {r['measure']} "
                   f"| {r['ratio']:.2f}x | {target} | {'yes' if r['met'] else 'NO'} "
                   f"| {r['file']} |")
    return "\n".join(out)


def plot(data: dict[str, Any], out_dir: Path | None) -> None:
    rows = [r for r in data["rows"] if r["target"]]
    fig, (ax,) = figure(1, 9.0, max(3.0, 0.28 * len(rows) + 1.0))
    margin = [(r["target"] / r["ratio"]) if r["le"] else (r["ratio"] / r["target"]) for r in rows]
    hosts = sorted({r["host"] for r in rows})
    colors = [f"C{hosts.index(r['host'])}" for r in rows]
    labels = [f"{r['host'][:18]} {r['cap']} {r['model'][:8]} {r['shape']} {r['measure']}"
              for r in rows]
    ax.barh(range(len(rows)), margin, color=colors)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("ratio over target (>= 1: met; TPOT rows: target / ratio)")
    ax.set_title(f"#31 acceptance, newest result per host and measure ({len(rows)} rows)",
                 fontsize=8)
    save_figure(fig, NAME, out_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the results lie")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    data = collect(args.results)
    print(table(data["rows"]))
    for s in data["skipped"]:
        print(f"left out {s['file']}: {s['why']}")
    for m in data["not_measured"]:
        print(f"not measured: {m['host']}, cap {m['cap']}, {m['model']} {m['shape']} "
              f"{m['measure']}")
    out_dir = args.out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{NAME}.json"
    out.write_text(json.dumps(data, indent=1) + "\n")
    if data["rows"]:
        plot(data, out_dir)
    print(f"every measured row met: {data['all_met']}; "
          f"{len(data['not_measured'])} expected rows not measured -> {out}")


if __name__ == "__main__":
    main()
