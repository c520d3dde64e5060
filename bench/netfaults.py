"""Faults between hosts, simulated on this machine (#49 item 4).

Router, prefill and decode servers each run in a network namespace of their own
(pdcore.testing.netns: one host address each, a cuttable link per pair: router-P, router-D,
P-D), over the tcp transfer backend (`--backend` picks another). Userspace fault proxies
(pdcore.testing.fault_proxy) sit on the router's HTTP paths to P and D and on D's path to P's
bootstrap server. Closed-loop clients (one plain, one streamed, greedy, text checked against an
undisturbed run) run through the router the whole time, while the scenarios run one after the
other, each for --fault-s seconds:

- latency: 20-100 ms on every chunk through the proxies, each way;
- loss: 3% of the chunks through the proxies lost (held a TCP retransmission timeout, 0.2-0.4 s)
  and 3% of the new connections broken (reset) after a random few bytes;
- resets: every open connection through the proxies reset every 5 s;
- partition P-D, partition D-router: that link cut (frames dropped both ways, no refusal);
- isolate D: every link of decode-0 cut.

Faults hit decode-0; with --decode 2 (the default) decode-1 is the healthy alternative the
router's retries and request migration move requests to, so the target is 0 failed as well as
0 wrong. Per scenario: requests ok / failed (by kind) / wrong / hung (no answer in --hung-s),
the recovery times after the fault ends: until the first request started after it succeeds
(`served_again_s`), until decode-0 itself finishes a request again (`faulted_d_serving_s`, from
its sglang:num_requests counter) and until every server's pages are at rest; each checked
against one heartbeat plus the transfer timeout. Writes
bench/results/netfaults.json + .png (netfaults_<backend> for another backend). Needs root
(namespaces); without it, it says so and exits 0.

    python bench/netfaults.py               # 30 s faults, a tiny random model
    python bench/netfaults.py --quick       # 8 s faults
    python bench/netfaults.py --model-path /path/model --backend mooncake
    python bench/netfaults.py --only "partition P-D" --tag pd_cut_before \
        --router-flags=--disable-pair-circuit-breaker   # the router's pair circuits off
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, save_figure, summary  # noqa: E402

from pdcore.config import ADMIN_KEY_ENV, CLUSTER_SECRET_ENV  # noqa: E402
from pdcore.testing import netns  # noqa: E402
from pdcore.testing.fault_proxy import FaultProxy  # noqa: E402
from pdcore.testing.pages import load_at_rest  # noqa: E402
from pdcore.testing.router_list import read_stream  # noqa: E402

PROMPTS = ["Hello there", "The capital of France is", "One two three four", "Once upon a time"]
HTTP, BOOT, ROUTER = 30000, 8998, 8000  # real ports (each host has its own address)
PROXY_HTTP, PROXY_BOOT = 31000, 9998  # the proxies' ports, on the same host addresses


def body(prompt: str, stream: bool, n: int) -> dict[str, Any]:
    return {"text": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}


def one_request(http: httpx.Client, url: str, prompt: str, stream: bool, n: int,
                hung_s: float) -> tuple[Any, str]:
    try:
        if not stream:
            r = http.post(url + "/generate", json=body(prompt, False, n), timeout=hung_s)
            return (200, r.json()["text"]) if r.status_code == 200 else (r.status_code, r.text)
        with http.stream("POST", url + "/generate", json=body(prompt, True, n),
                         timeout=hung_s) as r:
            return read_stream(r, cut=200)
    except httpx.TimeoutException:
        return "hung", ""
    except httpx.HTTPError as e:
        return type(e).__name__, str(e)[:200]


class Cluster:
    """The processes and proxies inside a NetLab; `stop()` ends them all."""

    def __init__(self, lab: netns.NetLab, decodes: list[str], args: argparse.Namespace,
                 model: str, logs: Path) -> None:
        self.lab, self.decodes, self.args, self.logs = lab, decodes, args, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.proxies: list[FaultProxy] = []
        self.env = {**os.environ, CLUSTER_SECRET_ENV: secrets.token_hex(16),
                    ADMIN_KEY_ENV: secrets.token_hex(32),
                    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(args.transfer_timeout_s),
                    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(args.transfer_timeout_s),
                    "OMP_NUM_THREADS": "1"}
        # the transfer libraries over TCP (no RDMA device in a namespace)
        self.env.update({"mooncake": {"MOONCAKE_PROTOCOL": "tcp"},
                         "nixl": {"UCX_TLS": "tcp"}}.get(args.backend, {}))
        self.model = model

    def real(self, node: str) -> str:
        return f"http://{self.lab.addr(node)}:{HTTP}"

    def _spawn(self, node: str, argv: list[str]) -> None:
        out = open(self.logs / f"{node}.log", "ab")  # noqa: SIM115 (closed with the process)
        self.procs[node] = subprocess.Popen(self.lab.exec_argv(node, argv), stdout=out,
                                            stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)

    def start(self) -> None:
        lab, py = self.lab, [sys.executable, "-m", "pdcore"]
        common = ["--model-path", self.model, "--port", str(HTTP), "--page-size", "4",
                  "--max-total-tokens", "4096", "--skip-server-warmup",
                  "--disaggregation-transfer-backend", self.args.backend,
                  "--cpu-omp-threads-bind", "nobind"]
        self._spawn("p", py + ["serve", "--host", lab.addr("p"), *common,
                               "--disaggregation-mode", "prefill",
                               "--disaggregation-bootstrap-port", str(BOOT)])
        for d in self.decodes:
            self._spawn(d, py + ["serve", "--host", lab.addr(d), *common,
                                 "--disaggregation-mode", "decode"])
        # the proxies: router -> P and D over HTTP, D -> P's bootstrap server
        self._proxy("p", PROXY_HTTP, HTTP)
        self._proxy("p", PROXY_BOOT, BOOT)
        for d in self.decodes:
            self._proxy(d, PROXY_HTTP, HTTP)
        self.wait_health([self.real(n) for n in ["p", *self.decodes]], 600)
        router = py + ["router", "--pd-disaggregation", "--host", lab.addr("r"), "--port",
                       str(ROUTER), "--policy", "round_robin",
                       "--health-check-interval-secs", str(self.args.heartbeat_s),
                       "--health-check-timeout-secs", "2",
                       "--prefill", f"http://{lab.addr('p')}:{PROXY_HTTP}", str(PROXY_BOOT)]
        for d in self.decodes:
            router += ["--decode", f"http://{lab.addr(d)}:{PROXY_HTTP}"]
        self._spawn("r", router + self.args.router_flags.split())
        self.wait_health([self.url], 120)

    @property
    def url(self) -> str:
        return f"http://{self.lab.addr('r')}:{ROUTER}"

    def _proxy(self, node: str, listen: int, target: int) -> None:
        addr = self.lab.addr(node)
        made: list[FaultProxy] = []

        def start() -> None:  # a thread in the node's namespace: the proxy listens there
            self.lab.enter(node)
            made.append(FaultProxy(addr, listen, addr, target, seed=len(self.proxies)).start())

        t = threading.Thread(target=start)
        t.start()
        t.join(30)
        if not made:
            raise RuntimeError(f"the proxy {node}:{listen} did not start")
        self.proxies.extend(made)

    def wait_health(self, urls: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=3) as http:
            for url in urls:
                while True:
                    for node, p in self.procs.items():
                        if p.poll() is not None:
                            tail = (self.logs / f"{node}.log").read_text()[-3000:]
                            raise RuntimeError(f"{node} exited with {p.returncode}:\n{tail}")
                    try:
                        if http.get(url + "/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{url} not healthy in {timeout:.0f} s")
                    time.sleep(0.5)

    def finished(self, node: str) -> float | None:
        """`node`'s sglang:num_requests_total (requests it finished well), None unreachable."""
        try:
            with httpx.Client(timeout=3) as http:
                text = http.get(self.real(node) + "/metrics").text
        except httpx.HTTPError:
            return None
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("sglang:num_requests_total"))

    def pages_at_rest(self) -> bool:
        try:
            with httpx.Client(timeout=5) as http:
                loads = [x for n in ["p", *self.decodes]
                         for x in http.get(self.real(n) + "/get_load").json()]
            return all(load_at_rest(x) for x in loads)
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False

    def stop(self) -> None:
        for p in self.proxies:
            p.stop()
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)


def scenarios(cluster: Cluster, args: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    """(name, begin, end): begin starts the fault, end removes it."""
    lab, d0, proxies = cluster.lab, cluster.decodes[0], cluster.proxies
    stop_resets = threading.Event()

    def set_all(**kw: Any) -> None:
        for p in proxies:
            for k, v in kw.items():
                setattr(p, k, v)

    def resets() -> None:
        stop_resets.clear()

        def loop() -> None:
            while not stop_resets.wait(5.0):
                for p in proxies:
                    p.reset_all()

        threading.Thread(target=loop, daemon=True).start()

    out = [
        ("latency 20-100 ms", lambda: set_all(latency_s=(0.02, 0.1)),
         lambda: set_all(latency_s=(0.0, 0.0))),
        ("loss 3%", lambda: set_all(loss=0.03, break_p=0.03),
         lambda: set_all(loss=0.0, break_p=0.0)),
        ("resets every 5 s", resets, stop_resets.set),
        ("partition P-D", lambda: lab.cut("p", d0), lambda: lab.heal("p", d0)),
        ("partition D-router", lambda: lab.cut("r", d0), lambda: lab.heal("r", d0)),
        ("isolate one D", lambda: lab.isolate(d0), lambda: lab.rejoin(d0)),
    ]
    return [s for s in out if not args.only or any(o in s[0] for o in args.only)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="default: a tiny random Llama")
    ap.add_argument("--decode", type=int, default=2, help="decode servers (faults hit the first)")
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--fault-s", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="8 s faults")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--hung-s", type=float, default=90.0)
    ap.add_argument("--heartbeat-s", type=float, default=5.0,
                    help="the router's health-check period (D's heartbeat to P is 5 s)")
    ap.add_argument("--transfer-timeout-s", type=float, default=30.0,
                    help="SGLANG_DISAGGREGATION_WAITING/BOOTSTRAP_TIMEOUT on every server")
    ap.add_argument("--recovery-limit-s", type=float, default=120.0)
    ap.add_argument("--only", nargs="*", default=[], help="scenario names containing these")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--router-flags", default="",
                    help="more flags for the router, e.g. '--disable-pair-circuit-breaker'")
    ap.add_argument("--tag", default="", help="a suffix for the result files' name")
    args = ap.parse_args()
    if args.quick:
        args.fault_s = 8.0
    ok, why = netns.available()
    if not ok:
        print(f"netfaults: skipped: {why}")
        return 0
    name = "netfaults" if args.backend == "tcp" else f"netfaults_{args.backend}"
    name += f"_{args.tag}" if args.tag else ""
    run = Run(name, vars(args))
    logs = Path(tempfile.mkdtemp(prefix="pdserve-netfaults-"))
    model = args.model_path
    if model is None:
        from pdcore.engine.model.tokenizer import default_model_file
        from pdcore.testing.tiny_models import make_tiny_model

        model = make_tiny_model(str(logs / "tiny"), tokenizer_from=default_model_file(),
                                max_positions=8192)
    decodes = [f"d{j}" for j in range(args.decode)]
    links = [("r", "p")] + [("r", d) for d in decodes] + [("p", d) for d in decodes]
    lab = netns.NetLab(["r", "p", *decodes], links)
    cluster = Cluster(lab, decodes, args, model, logs)
    results: list[dict[str, Any]] = []
    table: list[dict[str, Any]] = []
    try:
        lab.enter("r")  # this thread, and every client thread started from it, sits with the router
        cluster.start()
        url = cluster.url
        with httpx.Client() as http:
            ref = {p: one_request(http, url, p, False, args.max_new_tokens, 120)[1]
                   for p in PROMPTS}
        t_base = time.monotonic()
        stop = threading.Event()

        def client(k: int, stream: bool) -> None:
            with httpx.Client() as c:
                i = k
                while not stop.is_set():
                    p = PROMPTS[i % len(PROMPTS)]
                    i += 1
                    t0 = time.monotonic()
                    status, text = one_request(c, url, p, stream, args.max_new_tokens,
                                               args.hung_s)
                    results.append({"t": t0 - t_base, "end": time.monotonic() - t_base,
                                    "stream": stream, "status": status,
                                    "wrong": status == 200 and text != ref[p]})
                    if status != 200:
                        time.sleep(0.2)  # a failing cluster: no busy loop

        threads = [threading.Thread(target=client, args=(k, k % 2 == 1), daemon=True)
                   for k in range(2)]
        for t in threads:
            t.start()
        time.sleep(3)
        bound = args.heartbeat_s + args.transfer_timeout_s
        for label, begin, end in scenarios(cluster, args):
            before = [p.counters() for p in cluster.proxies]
            t_on = time.monotonic() - t_base
            begin()
            time.sleep(args.fault_s)
            end()
            t_off = time.monotonic() - t_base
            print(f"{label}: fault {t_on:.0f}-{t_off:.0f} s", flush=True)
            d0_at_end = cluster.finished(decodes[0])
            served_s = d0_s = rest_s = None
            deadline = time.monotonic() + args.recovery_limit_s
            while time.monotonic() < deadline and (served_s is None or d0_s is None):
                if served_s is None:
                    after = [r for r in results if r["t"] >= t_off and r["status"] == 200]
                    if after:
                        served_s = min(r["end"] for r in after) - t_off
                if d0_s is None:
                    n = cluster.finished(decodes[0])
                    if d0_at_end is None:
                        d0_at_end = n
                    elif n is not None and n > d0_at_end:
                        d0_s = time.monotonic() - t_base - t_off
                time.sleep(0.2)
            stop.set()  # pages at rest: with the clients paused
            for t in threads:
                t.join(args.hung_s + 10)
            settle = time.monotonic() + 30
            while time.monotonic() < settle and not cluster.pages_at_rest():
                time.sleep(0.2)
            rest_s = time.monotonic() - t_base - t_off
            at_rest = cluster.pages_at_rest()
            rows = [r for r in results if t_on <= r["t"] < (time.monotonic() - t_base)]
            during = [r for r in rows if r["t"] < t_off]
            failed: dict[str, int] = {}
            for r in rows:
                if r["status"] != 200:
                    failed[str(r["status"])] = failed.get(str(r["status"]), 0) + 1
            entry = {"scenario": label, "fault_start_s": t_on, "fault_end_s": t_off,
                     "requests": len(rows), "during_fault": len(during),
                     "ok": sum(r["status"] == 200 for r in rows), "failed": failed,
                     "wrong": sum(r["wrong"] for r in rows),
                     "hung": sum(r["status"] == "hung" for r in rows),
                     "served_again_s": served_s, "faulted_d_serving_s": d0_s,
                     "pages_at_rest_s": rest_s, "bound_s": bound,
                     "within_bound": served_s is not None and d0_s is not None and
                     max(served_s, d0_s) <= bound,
                     "pages_at_rest": at_rest,
                     # what went through the proxies meanwhile (the router keeps connections
                     # alive: few new ones, so `loss` breaks few)
                     "proxied": {k: sum(p.counters()[k] - b[k] for p, b in
                                        zip(cluster.proxies, before, strict=True))
                                 for k in ("connections", "broken", "lost")},
                     "latency_during": summary([r["end"] - r["t"] for r in during
                                                if r["status"] == 200])}
            table.append(entry)
            print(json.dumps(entry), flush=True)
            # the clients again for the next scenario
            stop.clear()
            threads = [threading.Thread(target=client, args=(k, k % 2 == 1), daemon=True)
                       for k in range(2)]
            for t in threads:
                t.start()
            time.sleep(3)
        stop.set()
        for t in threads:
            t.join(args.hung_s + 10)
    finally:
        cluster.stop()
        lab.close()
    data = {"scenarios": table, "requests": results,
            "totals": {"requests": len(results),
                       "failed": sum(r["status"] != 200 for r in results),
                       "wrong": sum(r["wrong"] for r in results),
                       "hung": sum(r["status"] == "hung" for r in results)},
            "logs": str(logs)}
    out_dir = Path(args.out_dir) if args.out_dir else None
    path = run.finish(data, out_dir)
    plot(table, results, name, out_dir)
    print(f"wrote {path}")
    for e in table:
        print(f"  {e['scenario']:<24} ok {e['ok']:>4}  failed {sum(e['failed'].values()):>3}  "
              f"wrong {e['wrong']}  hung {e['hung']}  served again "
              f"{_s(e['served_again_s'])} s, decode-0 {_s(e['faulted_d_serving_s'])} s "
              f"(bound {e['bound_s']:.0f})  pages at rest {e['pages_at_rest']}")
    return 0


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot(table: list[dict[str, Any]], results: list[dict[str, Any]], name: str,
         out_dir: Path | None) -> None:
    """One panel per scenario: each request's latency against its start (from the fault's
    start), the fault shaded; up to the next scenario's fault."""
    if not table:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(table))
    fig, axes = plt.subplots((len(table) + cols - 1) // cols, cols,
                             figsize=(4.5 * cols, 3.4 * ((len(table) + cols - 1) // cols)),
                             squeeze=False)
    for k, (ax, e) in enumerate(zip(axes.flat, table, strict=False)):
        t0, t1 = e["fault_start_s"], e["fault_end_s"]
        until = table[k + 1]["fault_start_s"] if k + 1 < len(table) else float("inf")
        rows = [r for r in results if t0 - 3 <= r["t"] < until]
        for ok, color, label in ((True, "tab:green", "ok"), (False, "tab:red", "failed")):
            sel = [r for r in rows if (r["status"] == 200 and not r["wrong"]) == ok]
            ax.scatter([r["t"] - t0 for r in sel], [r["end"] - r["t"] for r in sel], s=8,
                       c=color, label=label)
        ax.axvspan(0, t1 - t0, color="tab:gray", alpha=0.2, label="fault")
        served = e["served_again_s"]
        ax.set_title(f"{e['scenario']}: served again "
                     f"{'-' if served is None else f'{served:.1f}'} s after", fontsize=9)
        ax.set_xlabel("request start, s from the fault's start")
        ax.set_ylabel("latency, s")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(table):]:
        ax.set_visible(False)
    save_figure(fig, name, out_dir)


if __name__ == "__main__":
    sys.exit(main())
