"""Side-by-side timing shared by the op benchmarks: every implementation once per round, in a rotating
order, so that load from other processes on a shared machine hits them alike; ratios come from the
medians of one run. On CUDA also each call captured in a CUDA graph and replayed (`graphed`): the
kernels' own time, without the host's launch and dispatch cost, which at a latent batch's few
microseconds of work is most of a plain call's time."""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from _env import RESULTS, Results


def timed(fn, device: torch.device, n: int = 1) -> float:
    """Seconds per call over `n` calls back to back (one synchronisation at each end)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def interleave(calls: dict, device: torch.device, rounds: int, per_round: int = 1) -> dict[str, list[float]]:
    """{name: seconds per call, one figure per round} for `calls` {name: fn}, each warmed up once first;
    `per_round` calls back to back make one round's figure."""
    names = list(calls)
    for fn in calls.values():
        fn()
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            times[n].append(timed(calls[n], device, per_round))
    return times


def graphed(fn, warmup: int = 3):
    """`fn` captured in a CUDA graph: a function that replays it (the PyTorch recipe: warm-up calls on a
    side stream, then the capture). Raises where the call cannot be captured; the caller reports that."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


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
