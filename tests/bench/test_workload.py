"""bench/workload.py's ShareGPT-like mix is the same for a seed, follows its stated log-normal
shape within its bounds, and arrives as a Poisson process whose rate leaves the lengths alone;
bench/goodput.py's search ends between the last served and the first missed rate."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import goodput
import workload


def test_the_mix_is_seeded_bounded_and_log_normal() -> None:
    shape = workload.Shape()
    a = workload.requests(800, 49152, seed=3)
    assert a[:50] == workload.requests(50, 49152, seed=3)
    assert a[:50] != workload.requests(50, 49152, seed=4)
    ins, outs = [len(r.prompt) for r in a], [r.max_tokens for r in a]
    assert shape.in_min <= min(ins) and max(ins) <= shape.in_max
    assert shape.out_min <= min(outs) and max(outs) <= shape.out_max
    assert abs(statistics.median(ins) / shape.in_median - 1) < 0.12
    assert abs(statistics.median(outs) / shape.out_median - 1) < 0.12
    assert statistics.fmean(ins) > 1.4 * statistics.median(ins)  # the long right tail
    assert all(100 <= t < 49152 for r in a[:50] for t in r.prompt)


def test_poisson_arrivals_leave_the_lengths_alone() -> None:
    closed = workload.requests(500, 1000, seed=1, shape=workload.QUICK)
    opened = workload.requests(500, 1000, seed=1, shape=workload.QUICK, rate=4.0)
    assert [r.prompt for r in closed] == [r.prompt for r in opened]
    times = [r.arrival for r in opened]
    assert all(b > a for a, b in zip(times, times[1:]))
    assert abs(times[-1] / 500 - 0.25) < 0.05  # mean gap 1 / rate


def test_goodput_search_brackets_the_limit(monkeypatch) -> None:
    tried = []

    def fake(url, rate, args, shape, voc):
        tried.append(rate)
        return {"rate": rate, "served": rate <= 1.7}

    monkeypatch.setattr(goodput, "trial", fake)
    args = goodput.parse_args(["--rate-start", "0.5", "--rate-step", "2", "--bisect", "3"])
    out = goodput.search("http://unused", args, workload.Shape(), 100)
    assert tried[:3] == [0.5, 1.0, 2.0] and len(tried) == 6
    assert 1.5 <= out["goodput_req_s"] <= 1.7 < out["first_missed_req_s"] <= 2.0


def test_a_trial_is_judged_by_p99s_or_by_attainment(monkeypatch) -> None:
    """Ten requests, one of them slow to start: its TTFT is the p99, so the p99 rule misses the
    rate while DistServe's rule at 90% attainment serves it (and at 95% does not)."""
    from serving import Result

    def result(ttft: float) -> Result:  # 11 tokens 50 ms apart: TPOT 50 ms
        return Result(prompt_len=8, start=0.0, ttft=ttft, tokens=11, end=ttft + 0.5,
                      chunk_times=[ttft + 0.05 * i for i in range(11)])

    results = [result(0.2)] * 9 + [result(5.0)]

    async def fake_loop(url, reqs, timeout, sampling):
        return results, 10.0

    monkeypatch.setattr(goodput, "open_loop", fake_loop)
    verdicts = {}
    for rule in ([], ["--attainment", "0.9"], ["--attainment", "0.95"]):
        args = goodput.parse_args(["--requests", "10", *rule])
        verdicts[tuple(rule)] = goodput.trial("http://unused", 1.0, args, workload.QUICK, 1000)
    assert verdicts[()]["ttft_p99_s"] > 3.0 and not verdicts[()]["served"]
    assert verdicts[("--attainment", "0.9")]["attainment"] == 0.9
    assert verdicts[("--attainment", "0.9")]["served"]
    assert not verdicts[("--attainment", "0.95")]["served"]


def test_a_trial_of_several_seeds_is_one_stream_judged_per_seed(monkeypatch) -> None:
    """--seeds 3: three request sets back to back in one Poisson stream (the first is the
    one-seed trial's set); attainment is the mean of the sets' shares, their spread kept."""
    from serving import Result

    sent = []

    def result(ttft: float) -> Result:
        return Result(prompt_len=8, start=0.0, ttft=ttft, tokens=11, end=ttft + 0.5,
                      chunk_times=[ttft + 0.05 * i for i in range(11)])

    async def fake_loop(url, reqs, timeout, sampling):
        assert sampling == "default"  # no temperature sent, as most clients do
        sent.extend(reqs)
        # the second set's requests all start late: that set attains 0, the others 1
        return [result(5.0 if 4 <= i < 8 else 0.2) for i in range(len(reqs))], 10.0

    monkeypatch.setattr(goodput, "open_loop", fake_loop)
    args = goodput.parse_args(["--requests", "4", "--seeds", "3", "--attainment", "0.9"])
    out = goodput.trial("http://unused", 2.0, args, workload.QUICK, 1000)
    assert len(sent) == 12 and out["requests"] == 12
    times = [r.arrival for r in sent]
    assert all(b > a for a, b in zip(times, times[1:]))
    one = workload.requests(4, 1000, goodput.seeds_at(2.0, args)[0], workload.QUICK, rate=2.0)
    assert [r.prompt for r in sent[:4]] == [r.prompt for r in one]
    assert len(set(goodput.seeds_at(2.0, args))) == 3
    assert out["attainment_per_seed"] == [1.0, 0.0, 1.0]
    assert abs(out["attainment"] - 2 / 3) < 1e-9 and not out["served"]


def test_the_quiet_lock_waits_for_its_holder(tmp_path) -> None:
    import fcntl
    import os

    import pytest

    path = str(tmp_path / "quiet.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(RuntimeError, match="busy"):
            with goodput.quiet(path, timeout=1.2):
                pass
    finally:
        os.close(fd)
    with goodput.quiet(path, timeout=1.2) as waited:
        assert waited < 1.0
        other = os.open(path, os.O_RDWR)
        try:  # held now: another holder is refused
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)


def test_sse_lines_keep_json_strings_with_unicode_line_separators_whole() -> None:
    """A token's text may hold U+2028, U+0085 or another separator JSON allows raw in a string:
    the event stays one line (httpx's aiter_lines cut it, and the client counted a good answer
    as an error); CR LF split across chunks is one line end."""
    import asyncio
    import json

    from serving import sse_lines

    events = [{"choices": [{"text": t}]} for t in ("a\u2028b", "c\x85d", "\u2029\x1c\x0b")]
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in events)
    body += "data: [DONE]\n\n"

    async def chunks():  # odd-sized pieces: CR LF and the separators fall across chunk ends
        for i in range(0, len(body), 7):
            yield body[i:i + 7]

    async def collect():
        return [line async for line in sse_lines(chunks())]

    lines = asyncio.run(collect())
    data = [line[len("data: "):] for line in lines if line.startswith("data:")]
    assert [json.loads(d) for d in data[:-1]] == events and data[-1] == "[DONE]"
    assert all(line == "" for line in lines if not line.startswith("data:"))
    assert len(lines) == 2 * len(events) + 2
