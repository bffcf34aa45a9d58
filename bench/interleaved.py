"""Side-by-side timing shared by the op benchmarks: every implementation once per round, in a rotating
order, so that load from other processes on a shared machine hits them alike; ratios come from the
medians of one run."""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from _env import Results

RESULTS = Path(__file__).parent / "results"


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleave(calls: dict, device: torch.device, rounds: int) -> dict[str, list[float]]:
    """{name: seconds per round} for `calls` {name: fn}, each warmed up once first."""
    names = list(calls)
    for fn in calls.values():
        fn()
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            times[n].append(timed(calls[n], device))
    return times


def rows_of(times: dict[str, list[float]], base: str, **key) -> list[dict]:
    med = {n: statistics.median(ts) for n, ts in times.items()}
    return [{**key, "impl": n, "median_ms": med[n] * 1e3, "min_ms": min(ts) * 1e3, "x_vs_" + base: med[base] / med[n],
             "times_s": ts} for n, ts in times.items()]


def write(name: str, title: str, out: dict, table: list[str], notes: list[str]) -> None:
    """bench/results/NAME.{json,md}: `out` (with the machine and the command) and a markdown table."""
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), **out}
    lines = [f"# {title}", "", f"machine: {json.dumps(out['machine'])}  ", f"when: {out['when']}  ",
             f"command: `{out['command']}`", ""] + table + [""] + notes
    with Results(RESULTS) as res:  # both files in place together, only when the run completed
        res.text(f"{name}.json", json.dumps(out, indent=2))
        res.text(f"{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
