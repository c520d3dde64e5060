"""bench/across_hosts.py reads the benches' results back into #31's table: the newest result
stands per (CPU, cap, model, shape, measure), a result without a CPU is left out, caps are found
from the recorded variables or the older names, TPOT rows are met at or below their target, and
what no result holds is listed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import across_hosts

XEON = {"cpu": "Intel Xeon", "cpu_flags": ["avx2", "fma", "avx512f", "amx_bf16"]}
ZEN2 = {"cpu": "AMD EPYC 7B12", "cpu_flags": ["avx2", "fma"]}


def vs_vllm(name: str, machine: dict, time: str, ratio: float, tpot: float, **config) -> dict:
    return {"name": name, "machine": {**machine, "time": time},
            "config": {"input_len": 128, "output_len": 64, "concurrency": 8,
                       "model_path": "/m/smollm2-hf", **config},
            "acceptance": {
                "unified_f32_tok_s": {"ratio": ratio, "target": 1.2, "met": ratio >= 1.2},
                "unified_f32_tpot": {"ratio": tpot, "target": 1.0, "met": tpot <= 1.0}}}


def write(folder: Path, name: str, data: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(data))


def test_newest_result_stands_caps_are_found_and_gaps_listed(tmp_path: Path) -> None:
    write(tmp_path, "vs_vllm_old", vs_vllm("vs_vllm_old", XEON, "2026-12-01T10:00:00", 1.1, 0.9))
    write(tmp_path, "vs_vllm_new", vs_vllm("vs_vllm_new", XEON, "2026-12-05T10:00:00", 1.4, 0.6))
    capped = vs_vllm("vs_vllm_c", {**XEON, "isa_caps": {"PDCORE_CPU_ISA": "avx2"}},
                     "2026-12-05T11:00:00", 1.3, 0.7)
    write(tmp_path, "vs_vllm_c", capped)
    write(tmp_path, "vs_vllm_cap_avx2_named", vs_vllm("vs_vllm_cap_avx2_named", ZEN2,
                                                      "2026-12-02T10:00:00", 0.8, 1.2))
    write(tmp_path, "vs_vllm_nocpu", vs_vllm("vs_vllm_nocpu", {}, "2026-12-05T12:00:00", 9, 0.1))
    write(tmp_path, "tpot_floor_x", {"name": "tpot_floor_x",
                                     "machine": {**XEON, "time": "2026-12-05T09:00:00"},
                                     "config": "{'model_path': None}",
                                     "tpot_over_floor": {"batch1": 1.2, "batch8": 1.7}})
    data = across_hosts.collect(tmp_path)
    rows = {(r["host"], r["cap"], r["measure"]): r for r in data["rows"]}
    xeon, zen2 = "Intel Xeon (AMX)", "AMD EPYC 7B12 (AVX2)"
    assert rows[(xeon, "-", "unified_f32_tok_s")]["ratio"] == 1.4  # the newest of two
    assert rows[(xeon, "-", "unified_f32_tok_s")]["older_results"] == 1
    assert rows[(xeon, "avx2", "unified_f32_tok_s")]["ratio"] == 1.3  # cap from isa_caps
    assert rows[(zen2, "avx2", "unified_f32_tok_s")]["met"] is False  # cap from the name
    assert rows[(zen2, "avx2", "unified_f32_tpot")]["le"] is True
    floor = rows[(xeon, "-", "tpot_over_floor")]
    assert floor["ratio"] == 1.7 and floor["met"] is False and floor["target"] == 1.6
    assert data["skipped"] == [{"file": "vs_vllm_nocpu.json", "why": "no CPU recorded"}]
    assert data["all_met"] is False
    gaps = {(m["host"], m["cap"], m["model"], m["shape"], m["measure"])
            for m in data["not_measured"]}
    assert (xeon, "-", "SmolLM2-135M", "128/64 c8", "1p1d_f32_tok_s") in gaps
    assert (xeon, "-", "Llama-1B-shaped", "128/64 c8", "unified_f32_tok_s") in gaps
    assert (xeon, "-", "SmolLM2-135M", "128/64 c8", "unified_f32_tok_s") not in gaps
    assert (zen2, "avx2", "SmolLM2-135M", "batch 8", "tpot_over_floor") in gaps
    assert not any(g[1] == "avx2" and g[2] == "Llama-1B-shaped" for g in gaps)


def test_the_committed_results_read_back_with_their_own_ratios(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "across_hosts.py"),
                           "--out-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "across_hosts.json").read_text())
    assert (tmp_path / "across_hosts.png").stat().st_size > 0
    assert data["rows"], "the committed results hold no rows"
    for row in data["rows"]:
        assert row["host"], row
        stored = json.loads((ROOT / "bench" / "results" / row["file"]).read_text())
        if row["measure"] == "tpot_over_floor":
            assert row["ratio"] == stored["tpot_over_floor"]["batch8"]
        else:
            assert row["ratio"] == stored["acceptance"][row["measure"]]["ratio"]
    assert "| host |" in proc.stdout
