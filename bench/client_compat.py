"""Real serving clients through PD (#32: "16/16 through both routers"): vLLM's `vllm bench serve`
(completions and chat), and when installed guidellm and SGLang's `bench_serving` (its `sglang`
backend on /generate, `sglang-oai` and `sglang-oai-chat`), against a 1P1D pair (tcp) on SmolLM2
behind our router and behind sglang-router. Counts the requests each client saw complete.

Run: `python bench/client_compat.py --model-path /work/smollm2-hf --vllm-python
/work/venv-vllm/bin/python [--guidellm /path/to/guidellm] [--sglang-python PY]`; JSON + PNG in
bench/results/client_compat.*. Not a timing: the counts are the result.

SGLang's client: `pip install --no-deps sglang` plus what `sglang.bench_serving` imports
(numpy aiohttp requests tqdm transformers orjson psutil pybase64 pillow msgspec pyzmq datasets
...) in a venv of its own. The module imports one constant (FAKE_BOOTSTRAP_HOST) from sglang's
server package, which pulls model configs that need a torchvision built for that torch: the run
puts that one constant in place of the server module (`_SGLANG_SHIM`), the client is unchanged.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, save_figure

NAME = "client_compat"
PROMPTS = 16


def _vllm(vllm_python: str, url: str, model: str, tokenizer: str, chat: bool,
          out: Path) -> dict[str, Any]:
    name = "chat" if chat else "completions"
    cmd = [str(Path(vllm_python).with_name("vllm")), "bench", "serve",
           "--backend", "openai-chat" if chat else "openai", "--base-url", url,
           "--endpoint", "/v1/chat/completions" if chat else "/v1/completions",
           "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", "64", "--random-output-len", "16",
           "--num-prompts", str(PROMPTS), "--max-concurrency", "4", "--save-result",
           "--result-dir", str(out), "--result-filename", f"vllm_{name}.json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    path = out / f"vllm_{name}.json"
    done = json.loads(path.read_text()).get("completed", 0) if path.exists() else 0
    return {"client": f"vllm bench serve ({name})", "completed": done, "of": PROMPTS,
            "rc": run.returncode, "tail": (run.stdout + run.stderr)[-600:] if done < PROMPTS
            else ""}


def _guidellm(exe: str, url: str, tokenizer: str, out: Path) -> dict[str, Any]:
    """guidellm 0.8's `run` (its arguments are kind=... lists)."""
    path = out / "guidellm.json"
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={url}/v1",
           "--profile", "kind=concurrent,streams=4",
           "--constraint", f"kind=max_requests,count={PROMPTS}",
           "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={path}", "--disable-console-interactive",
           "--disable-progress"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    done = 0
    if path.exists():
        text = path.read_text()
        try:
            bench = json.loads(text)["benchmarks"][0]
            reqs = bench.get("requests", {})
            done = len(reqs.get("successful", [])) if isinstance(reqs, dict) else 0
            if not done:  # the totals when the per-request lists are sampled away
                done = int(bench["metrics"]["request_totals"]["successful"])
        except (ValueError, KeyError, IndexError, TypeError):
            done = text.count('"successful"')
    return {"client": "guidellm", "completed": done, "of": PROMPTS, "rc": run.returncode,
            "tail": (run.stdout + run.stderr)[-600:] if done < PROMPTS else ""}


_SGLANG_SHIM = """
import runpy, sys, types
m = types.ModuleType("sglang.srt.disaggregation.utils")
m.FAKE_BOOTSTRAP_HOST = "2.2.2.2"
sys.modules["sglang.srt.disaggregation.utils"] = m
sys.argv = ["bench_serving", *sys.argv[1:]]
runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
"""


def _sglang(python: str, url: str, model: str, tokenizer: str, backend: str,
            out: Path) -> dict[str, Any]:
    """SGLang's bench_serving, random token ids (no dataset download), its JSONL result."""
    path = out / f"sglang_{backend}.jsonl"
    cmd = [python, "-c", _SGLANG_SHIM, "--backend", backend, "--base-url", url,
           "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random-ids",
           "--random-input-len", "64", "--random-output-len", "16", "--random-range-ratio", "1",
           "--num-prompts", str(PROMPTS), "--max-concurrency", "4", "--disable-tqdm",
           "--output-file", str(path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    done = 0
    if path.exists():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        done = int(json.loads(lines[-1]).get("completed", 0)) if lines else 0
    return {"client": f"sglang bench_serving ({backend})", "completed": done, "of": PROMPTS,
            "rc": run.returncode, "tail": (run.stdout + run.stderr)[-600:] if done < PROMPTS
            else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True, help="HF folder (the clients' tokenizer)")
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--guidellm", default=None, help="the guidellm executable, if installed")
    ap.add_argument("--sglang-python", default=None,
                    help="a python with sglang's bench_serving importable (see the docstring)")
    a = ap.parse_args()
    from pdcore.testing.processes import PDCluster

    run = Run(NAME, vars(a))
    rows: list[dict[str, Any]] = []
    for router in ("pdcore", "sglang"):
        cluster = PDCluster("tcp", model_path=a.model_path, router=router).start()
        try:
            model = httpx.get(cluster.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp)
                results = [_vllm(a.vllm_python, cluster.url, model, a.model_path, chat, out)
                           for chat in (False, True)]
                if a.guidellm:
                    results.append(_guidellm(a.guidellm, cluster.url, a.model_path, out))
                if a.sglang_python:
                    results += [_sglang(a.sglang_python, cluster.url, model, a.model_path,
                                        backend, out)
                                for backend in ("sglang", "sglang-oai", "sglang-oai-chat")]
        finally:
            cluster.stop()
        for r in results:
            r["router"] = router
            print(f"{router:7s} {r['client']:32s} {r['completed']}/{r['of']}", flush=True)
        rows.extend(results)
    path = run.finish({"rows": rows})
    fig, (ax,) = figure(1, width=8)
    labels = [f"{r['client']}\n{r['router']}" for r in rows]
    ax.barh(labels, [r["completed"] for r in rows], color="#3a7")
    ax.set_xlim(0, PROMPTS)
    ax.set_xlabel(f"requests completed of {PROMPTS}")
    save_figure(fig, NAME)
    print(path)


if __name__ == "__main__":
    main()
