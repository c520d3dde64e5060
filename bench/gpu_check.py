"""pdserve on an accelerator: the checks that only ever ran on CPU, as one script.

1. engine (in process, `LLMEngine`, `--device DEVICE`): a tiny random Llama and a random EAGLE-1
   head (pdcore/testing/tiny_models.py). For each dtype (float32; bfloat16 on an accelerator)
   and each layout (page size 4 and 1 with the prompts batched, page size 16 one prompt at a
   time, chunked prefill), greedy output without speculation, with EAGLE and with NGRAM (every
   draft verified: PDSERVE_SPEC_GATE=0), the first prompts again from the prefix cache: any
   request error, drafts that raised, pages not at rest, and EAGLE / NGRAM output that differs
   from the plain engine's are failures. float32 output is checked against transformers' greedy
   on the CPU and on DEVICE (near ties excepted, `pdcore.testing.greedy.check_greedy`); bf16
   differences are reported with the top-2 gap where the outputs part (a near tie in bf16 is no
   bug). A sampled request (temperature, top-p/k, penalties, logit bias, seed) with and without
   EAGLE must come back without an error.
2. PD (servers on 127.0.0.1, EAGLE on both, float32): a prefill and a decode server per transfer
   backend (default tcp and fake), paired by hand as the router does. Over a backend that moves
   data, D's output must equal the unified engine's; over every backend D's first decode step
   must draft from P's chain start (3 new tokens: spec_verify_ct >= 1), every chain start sent
   by P adopted by D (none dropped), and D's first token (from the aux row) equal the unified
   one. The chain start is the aux row's vector: device -> host copy on P, host -> device on D.
   A server that cannot start is reported with its log's tail (tcp moves host memory only, so
   with KV pools on a GPU it refuses to register them: that refusal is expected and reported).
3. `--baseline DIR`: the engine check's first layout once more in a subprocess over another
   pdcore tree (the code before a fix), with and without the native kernels, so a report can
   show what failed before.

Run: `python bench/gpu_check.py --device cuda` (writes $OUT/gpu_check.json where OUT is set,
else bench/results/gpu_check.json); `--device cpu` runs the same on the CPU (slower; use
`--quick` and `--pd-backends tcp` there). Exit status 0 when no check failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

from gpu_check_engine import (  # noqa: F401 - the baseline probe (PROBE) reads them here
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    NEW,
    PD_NEW,
    SPEC_ENV,
    VOCAB,
    Report,
    _now,
    _tb,
    engine_args,
    prompts,
    run_engine,
)

# bf16 keeps 8 significant bits: logits in [8, 16) come in steps of 1/16, so two candidates a
# step or two apart are a tie that the accumulation order (a verify's GEMM shape is not a
# decode step's) decides; seen on an H200: gaps of exactly 0, 1/32 and 1/16
BF16_TIE = 0.125


def make_models(root: Path) -> dict[str, str]:
    from pdcore.testing.tiny_models import make_eagle_head, make_tiny_model

    target = make_tiny_model(str(root / "target"), vocab_size=VOCAB, seed=5, hidden=HIDDEN,
                             layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS)
    write_tokenizer(target)  # the servers need one; the engine reads token ids only
    head = make_eagle_head(str(root / "head"), vocab=VOCAB, hidden=HIDDEN, heads=HEADS,
                           kv_heads=KV_HEADS, seed=1)
    return {"target": target, "head": head}


def write_tokenizer(folder: str) -> None:
    """A word-level tokenizer over the tiny vocabulary ("<t0>" .. "<t511>"; 1 BOS, 2 EOS),
    made here: no download, no other model's files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>",
                                   eos_token="<t2>")
    fast.save_pretrained(folder)


# -- transformers' greedy -------------------------------------------------------------------------
def hf_reference(target: str, ps: list[list[int]], device: str) -> list[Any]:
    """transformers' greedy (pdcore.testing.greedy.Reference) of each prompt on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdcore.testing.greedy import Reference

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()
    refs = []
    with torch.inference_mode():
        for ids in ps:
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=NEW,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens = out.sequences[0, len(ids):].tolist()
            lps, gaps = [], []
            for logits, t in zip(out.logits, tokens):
                lp = torch.log_softmax(logits[0].float(), -1)
                top = torch.topk(lp, 2).values
                lps.append(float(lp[t]))
                gaps.append(float(top[0] - top[1]))
            refs.append(Reference(tokens, lps, gaps))
    del model
    return refs


def _errors(outs: list[dict[str, Any]]) -> list[str]:
    return [f"request {i}: {o.get('error')}" for i, o in enumerate(outs) if o.get("error")]


def _gap(entry: Any) -> float | None:
    """top-1 - top-2 logprob of a logprob entry (logprob, token, [(lp, id), ...])."""
    top = entry[2] if len(entry) > 2 else None
    if not top or len(top) < 2:
        return None
    return float(top[0][0] - top[1][0])


def compare(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> dict[str, Any]:
    """Token-for-token equality of two engines' outputs; where they part, the step and the
    reference's top-2 logprob gap there (a near tie lets float rounding pick either)."""
    parts = []
    max_lp = 0.0
    for i, (a, b) in enumerate(zip(got, want)):
        x, y = a["output_ids"], b["output_ids"]
        n = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if n is None and len(x) != len(y):
            n = min(len(x), len(y))
        upto = len(x) if n is None else n
        for ea, eb in zip(a["output_logprobs"][:upto], b["output_logprobs"][:upto]):
            max_lp = max(max_lp, abs(ea[0] - eb[0]))
        if n is not None:
            gap = _gap(b["output_logprobs"][n]) if n < len(b["output_logprobs"]) else None
            parts.append({"request": i, "step": n, "got": x[n:n + 4], "want": y[n:n + 4],
                          "ref_top2_gap": gap})
    return {"equal": not parts, "parted": parts, "max_logprob_diff": max_lp}


def engine_section(rep: Report, models: dict[str, str], device: str, dtypes: list[str],
                   layouts: list[tuple[int, int, bool]], hf: dict[str, list[Any]]) -> None:
    from pdcore.messages.io import SamplingParams
    from pdcore.testing.greedy import check_greedy

    os.environ.update(SPEC_ENV)
    ps = prompts()
    sp = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    res: dict[str, Any] = rep.data.setdefault("engine", {})
    for dtype in dtypes:
        for page, chunk, batched in layouts:
            key = f"{dtype}/page{page}/chunk{chunk}/{'batched' if batched else 'one-by-one'}"
            cell: dict[str, Any] = res.setdefault(key, {})
            runs: dict[str, Any] = {}
            for algo in ("none", "EAGLE", "NGRAM"):
                try:
                    args = engine_args(models["target"], models["head"], algo, device, dtype,
                                       page, chunk)
                    r = run_engine(args, ps, batched, sp)
                except Exception:  # noqa: BLE001 - reported in the JSON
                    cell[algo] = {"exception": _tb()}
                    rep.fail(f"engine {key} {algo}: raised (see engine.{key}.{algo})")
                    continue
                runs[algo] = r
                st = r["stats"]
                info = {k: st.get(k) for k in (
                    "spec_verifies_total", "spec_draft_tokens_total", "spec_accepted_tokens_total",
                    "spec_accept_length", "spec_draft_passes_total", "spec_draft_failures_total")
                    if k in st}
                info.update(build_s=r["build_s"], generate_s=r["generate_s"],
                            at_rest=r["at_rest"], drafter_failures=r["drafter_failures"],
                            device=r["device"], errors=_errors(r["outs"]),
                            output_ids=[o["output_ids"] for o in r["outs"]])
                cell[algo] = info
                if info["errors"]:
                    rep.fail(f"engine {key} {algo}: request errors {info['errors'][:2]}")
                if not r["at_rest"]:
                    rep.fail(f"engine {key} {algo}: KV pages not at rest after the run")
                if algo != "none":
                    if r["drafter_failures"]:
                        rep.fail(f"engine {key} {algo}: {r['drafter_failures']} draft passes "
                                 "raised (drafts silently lost)")
                    if not st.get("spec_verifies_total"):
                        rep.fail(f"engine {key} {algo}: nothing was verified (no drafts)")
            base = runs.get("none")
            if base is None:
                continue
            for algo in ("EAGLE", "NGRAM"):
                if algo not in runs:
                    continue
                c = compare(runs[algo]["outs"], base["outs"])
                cell[f"{algo}_vs_none"] = c
                if not c["equal"]:
                    near = all(p["ref_top2_gap"] is not None and p["ref_top2_gap"] <= BF16_TIE
                               for p in c["parted"])
                    msg = (f"engine {key}: {algo} output differs from the plain engine's at "
                           f"{[(p['request'], p['step']) for p in c['parted']]}")
                    if dtype == "float32" or not near:
                        rep.fail(msg)
                    else:
                        rep.note(msg + " (bf16, near ties only)")
            if dtype != "float32":
                continue
            n = len(prompts())
            for where, refs in hf.items():
                verdicts = []
                for o, ref in zip(base["outs"][:n], refs):
                    try:
                        verdicts.append(check_greedy(
                            o["output_ids"], ref, [e[0] for e in o["output_logprobs"]],
                            logprob_tol=1e-3, tie_tol=1e-3))
                    except AssertionError as e:
                        verdicts.append(f"MISMATCH: {e}"[:600])
                cell[f"vs_transformers_{where}"] = verdicts
                bad = [v for v in verdicts if v.startswith("MISMATCH")]
                if bad:
                    rep.fail(f"engine {key}: differs from transformers on {where}: {bad[0]}")
            rep.dump()
    # sampled requests: every sampling option through the device's logits, with and without
    # a draft head (the rejection-sampling verify)
    sampled = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=7,
                             repetition_penalty=1.1, frequency_penalty=0.2,
                             presence_penalty=0.1, logit_bias={17: 1.5}, ignore_eos=True)
    for algo in ("none", "EAGLE"):
        try:
            args = engine_args(models["target"], models["head"], algo, device, dtypes[0], 4, 32)
            r = run_engine(args, prompts()[:3], True, sampled, top=0)
            errs = _errors(r["outs"])
            res[f"sampled/{algo}"] = {"errors": errs,
                                      "output_ids": [o["output_ids"] for o in r["outs"]]}
            if errs:
                rep.fail(f"engine sampled {algo}: {errs[:2]}")
        except Exception:  # noqa: BLE001 - reported in the JSON
            res[f"sampled/{algo}"] = {"exception": _tb()}
            rep.fail(f"engine sampled {algo}: raised")
    rep.dump()


# -- PD -------------------------------------------------------------------------------------------


PROBE = """
import json, sys, torch
from pdcore.messages.io import SamplingParams
sys.path.insert(0, {bench!r})
import gpu_check as g
import pdcore
models = json.loads({models!r})
out = {{"pdcore": pdcore.__file__}}
try:
    args = g.engine_args(models["target"], models["head"], {algo!r}, {device!r}, "float32", 4, 32)
    r = g.run_engine(args, g.prompts()[:3], True,
                     SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    out["errors"] = g._errors(r["outs"])
    out["output_ids"] = [o["output_ids"] for o in r["outs"]]
    out["drafter_failures"] = r["drafter_failures"]
except Exception:  # noqa: BLE001 - reported in the JSON
    import traceback
    out["exception"] = traceback.format_exc()[-4000:]
print("PROBE" + json.dumps(out))
"""


def baseline_section(rep: Report, models: dict[str, str], device: str, tree: str,
                     deadline: float) -> None:
    tree = str(Path(tree).resolve())  # the probes run from another folder
    res: dict[str, Any] = rep.data.setdefault("baseline", {"tree": tree})
    for name, algo, native in (("python", "none", "0"), ("python_eagle", "EAGLE", "0"),
                               ("native", "none", "1")):
        left = deadline - _now()
        if left < 30:
            res[name] = {"skipped": "out of time"}
            continue
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [tree, *filter(None, [os.environ.get("PYTHONPATH")])]), "PDCORE_NATIVE": native,
            **SPEC_ENV}
        code = PROBE.format(bench=str(Path(__file__).resolve().parent),
                            models=json.dumps(models), device=device, algo=algo)
        t0 = _now()
        try:
            p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                               text=True, timeout=min(left - 10, 180), check=False, cwd="/")
            line = next((x for x in p.stdout.splitlines() if x.startswith("PROBE")), None)
            res[name] = {"rc": p.returncode, "s": round(_now() - t0, 1),
                         "result": json.loads(line[5:]) if line else None,
                         "stderr_tail": p.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            res[name] = {"timeout": True, "stderr_tail": str(e.stderr or "")[-2000:]}
        rep.dump()


# -- main -----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--out", default=None, help="the JSON result (default: $OUT/gpu_check.json "
                    "where OUT is set, else bench/results/gpu_check.json)")
    ap.add_argument("--quick", action="store_true", help="one layout, float32 only")
    ap.add_argument("--pd-backends", default="tcp,fake",
                    help="comma-separated transfer backends for the PD check ('' skips it)")
    ap.add_argument("--baseline", default=None, help="a pdcore tree (its parent folder) to run "
                    "the first engine layout over too, in a subprocess")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="the baseline probes start only while this much time is not spent")
    a = ap.parse_args()
    t_start = _now()
    sys.path.insert(0, str(ROOT))  # this checkout's pdcore
    out = Path(a.out) if a.out else (Path(os.environ["OUT"]) / "gpu_check.json"
                                     if os.environ.get("OUT") else
                                     ROOT / "bench" / "results" / "gpu_check.json")
    rep = Report(out)
    import torch
    import transformers

    import pdcore

    dev = a.device
    info: dict[str, Any] = {
        "device": dev, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "pdcore": pdcore.__file__,
        "cuda_available": torch.cuda.is_available(), "argv": sys.argv[1:],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            rep.fail("--device cuda, but torch sees no CUDA device")
            rep.data["info"] = info
            rep.dump()
            return 1
        info["gpu"] = torch.cuda.get_device_name(0)
        info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    rep.data["info"] = info
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        try:
            models = make_models(Path(tmp))
        except Exception:  # noqa: BLE001 - reported in the JSON
            rep.data["models"] = {"exception": _tb()}
            rep.fail("making the tiny models raised")
            rep.dump()
            return 1
        hf: dict[str, list[Any]] = {}
        t0 = _now()
        for where in dict.fromkeys(["cpu", dev]):
            try:
                hf[where] = hf_reference(models["target"], prompts(), where)
            except Exception:  # noqa: BLE001 - reported in the JSON
                rep.data[f"transformers_{where}"] = {"exception": _tb()}
                rep.fail(f"transformers' greedy on {where} raised")
        if len(hf) == 2:
            same = [a_.tokens == b_.tokens for a_, b_ in zip(hf["cpu"], hf[dev])]
            rep.data["transformers_cpu_vs_device_equal"] = same
        info["transformers_s"] = round(_now() - t0, 1)
        rep.dump()
        dtypes = ["float32"] if a.quick or dev == "cpu" else ["float32", "bfloat16"]
        layouts = [(4, 32, True)] if a.quick else [(4, 32, True), (1, 32, True),
                                                   (16, 16, False)]
        t0 = _now()
        engine_section(rep, models, dev, dtypes, layouts, hf)
        info["engine_s"] = round(_now() - t0, 1)
        rep.dump()
        backends = [b for b in a.pd_backends.split(",") if b]
        if backends:
            t0 = _now()
            try:
                logs = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
                from gpu_check_pd import pd_section  # imports this module

                pd_section(rep, models, dev, backends, logs)
            except Exception:  # noqa: BLE001 - reported in the JSON
                rep.data.setdefault("pd", {})["exception"] = _tb()
                rep.fail("pd: raised")
            info["pd_s"] = round(_now() - t0, 1)
            rep.dump()
        if a.baseline:
            baseline_section(rep, models, dev, a.baseline, t_start + a.budget_s)
    info["total_s"] = round(_now() - t_start, 1)
    rep.dump()
    print(json.dumps({"ok": rep.data["ok"], "failures": rep.data["failures"],
                      "notes": rep.data["notes"], "total_s": info["total_s"]}, indent=1))
    return 0 if rep.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
