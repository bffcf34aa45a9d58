"""pytest-benchmark of the diffusion loss op together with the noise op: the per-step diffusion math,
eager vs torch.compile(reference) vs fused ops, forward + backward.

    pytest bench/bench_diffusion_loss.py --benchmark-only   # writes bench/results/kernels-<device>.{json,md}
    python bench/bench_diffusion_loss.py [--shapes latent-dit,pixel] # bench/results/kernels-bandwidth-<device>.*


The two ops are timed together, as one training step runs them: the fused loss regenerates the eps
the noise op drew, while the unfused baselines keep eps in memory between the two halves, so timing
either op alone would leave out the memory traffic that fusing saves.

Implementations (cases.py): the PyTorch reference math eagerly ("eager") and under torch.compile
("compile_ref"), and every fused backend that runs on the device: on CUDA the Triton kernels, and the
native ops of fasttrain._C (C++ on CPU, CUDA C++ on GPUs) where they are built. The Triton
interpreter is a correctness tool (~1000x slower) and is left out on CPU. The variants are
interleaved: each benchmark round runs every implementation once, in a rotating order, so that load
from other processes on a shared machine hits them alike; the medians per implementation and their
ratios come from the same run (bench/conftest.py). On CPU the run uses FASTTRAIN_BENCH_THREADS threads
(default 2).

Run as a script (bench/gpu_check.sh's first part) it measures what the op achieves against the
device's memory bandwidth: per implementation, a plain call (fwd + bwd, `--calls` back to back: what an
eager trainer pays, host dispatch included) and, on CUDA, the call captured in a CUDA graph and replayed
(the kernels' own time), forward alone and forward + backward. Bytes per second are the byte floor over
the graphed time, set against the device-to-device copy bandwidth measured in the same run
(cases.ceilings) and the H200's nominal ~4.3 TB/s; the fused ops' forward moves the whole floor and their
backward 2 bytes per gradient byte more (one scale), so their own forward and backward rates are given too.
"""
import json
import os
import statistics
import time
from functools import partial

import _env  # OpenMP's wait policy, before torch loads it
import pytest
import torch
from cases import SHAPES, Case, ceilings, count_launches, impls, machine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = impls(DEVICE)
if DEVICE == "cpu":
    torch.set_num_threads(int(os.environ.get("FASTTRAIN_BENCH_THREADS", "2")))


def _timed(fn):
    def call():
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return call


@pytest.mark.parametrize("shape", ["latent-dit", "pixel"])
def test_diffusion_math(benchmark, shape):
    case = Case(SHAPES[shape], DEVICE)
    calls = {impl: _timed(getattr(case, impl)) for impl in IMPLS}
    launches = {impl: count_launches(getattr(case, impl)) for impl in IMPLS}  # also warms (compiles)
    for call in calls.values():
        call()
    times = {impl: [] for impl in IMPLS}
    order = list(IMPLS)

    def one_round():
        for impl in order:
            times[impl].append(calls[impl]())
        order.append(order.pop(0))  # rotate, so no implementation always runs first

    rounds = 20 if DEVICE == "cuda" else 7
    benchmark.group = shape
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update({"shape": list(SHAPES[shape]), "device": DEVICE, "floor_bytes": case.floor_bytes,
                                 "threads": torch.get_num_threads(), "launches": launches,
                                 "times_s": {impl: ts for impl, ts in times.items()}})


NOMINAL_HBM = 4.3e12  # bytes/s: an H200's device-to-device copy, read + written (the figure to compare with)


def shape_arg(text: str) -> dict[str, tuple[int, ...]]:
    """`--shapes`: names of cases.SHAPES or explicit BxCxHxW sizes, comma-separated."""
    import argparse

    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item in SHAPES:
            out[item] = SHAPES[item]
            continue
        try:
            dims = tuple(int(d) for d in item.split("x"))
        except ValueError:
            dims = ()
        if len(dims) != 4 or min(dims) < 1:
            raise argparse.ArgumentTypeError(f"{item!r} is neither one of {', '.join(SHAPES)} nor BxCxHxW")
        out[item] = dims
    if not out:
        raise argparse.ArgumentTypeError("no shape given")
    return out


def bandwidth(shape, rounds: int, calls: int, interpret: bool, capture=None) -> list[dict]:
    """One shape: every implementation's plain and graphed times, interleaved (interleaved.interleave).
    `capture`: how a call is captured (interleaved.graphed on CUDA; None: plain calls alone)."""
    from interleaved import interleave

    case = Case(shape, DEVICE)
    names = impls(DEVICE, interpret=interpret)
    calls_of = {f"{n} plain": getattr(case, n) for n in names}
    failed = {}
    if capture is not None:
        for n in names:
            for bwd in (True, False):
                key = f"{n} graph {'fwd+bwd' if bwd else 'fwd'}"
                try:
                    calls_of[key] = capture(partial(getattr(case, n), backward=bwd))
                except Exception as e:  # reported in the table; the other columns go on
                    failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                    if DEVICE == "cuda":
                        torch.cuda.synchronize()
    times = interleave(calls_of, torch.device(DEVICE), rounds, calls)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for n in names:
        full, fwd = med.get(f"{n} graph fwd+bwd"), med.get(f"{n} graph fwd")
        bwd = full - fwd if full is not None and fwd is not None else None
        r = {"shape": list(shape), "impl": n, "plain_us": med[f"{n} plain"] * 1e6,
             "graph_us": full * 1e6 if full else None, "graph_fwd_us": fwd * 1e6 if fwd else None,
             "graph_bwd_us": bwd * 1e6 if bwd is not None else None, "floor_bytes": case.floor_bytes,
             "floor_GBps_plain": case.floor_bytes / med[f"{n} plain"] / 1e9,
             "floor_GBps_graph": case.floor_bytes / full / 1e9 if full else None,
             "times_s": {k: v for k, v in times.items() if k.startswith(n + " ")},
             "graph_failed": {k: v for k, v in failed.items() if k.startswith(n + " ")}}
        if n in ("triton", "native") and fwd and bwd and bwd > 0:  # the fused ops' own traffic
            r["fwd_GBps"] = case.floor_bytes / fwd / 1e9
            r["bwd_GBps"] = case.backward_bytes / bwd / 1e9
        rows.append(r)
    eager = next(r for r in rows if r["impl"] == "eager")
    comp = next(r for r in rows if r["impl"] == "compile_ref")
    for r in rows:
        key = "graph_us" if r["graph_us"] else "plain_us"
        r["x_vs_eager"] = eager[key] / r[key] if eager[key] else None
        r["x_vs_compile"] = comp[key] / r[key] if comp[key] else None
    return rows


def table(rows: list[dict], copy: float, rounds: int, calls: int) -> tuple[list[str], list[str]]:
    """The markdown table of `bandwidth`'s rows and its notes; `copy`: the measured copy GB/s."""
    def f(v, fmt="{:.1f}"):
        return fmt.format(v) if v is not None else "—"

    lines = ["| case | impl | plain µs | graph fwd+bwd µs | fwd µs | bwd µs | GB/s at the floor (graph) | "
             f"of copy ({copy:.0f} GB/s) | of 4.3 TB/s | fused fwd / bwd GB/s | × eager | × compile |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bw = r["floor_GBps_graph"]
        own = f"{r['fwd_GBps']:.0f} / {r['bwd_GBps']:.0f}" if "fwd_GBps" in r else "—"
        label = f"{r['case']} {'×'.join(map(str, r['shape']))}" if r["case"] in SHAPES else r["case"]
        lines.append(f"| {label} | {r['impl']} | {r['plain_us']:.1f} | {f(r['graph_us'])} | {f(r['graph_fwd_us'])} | "
                     f"{f(r['graph_bwd_us'])} | {f(bw, '{:.0f}')} | {f(bw and bw / copy, '{:.0%}')} | "
                     f"{f(bw and bw * 1e9 / NOMINAL_HBM, '{:.0%}')} | {own} | {f(r['x_vs_eager'], '{:.2f}')} | "
                     f"{f(r['x_vs_compile'], '{:.2f}')} |")
    notes = [f"Median of {rounds} interleaved rounds of {calls} calls each. plain: the call as a trainer makes it "
             "(host dispatch included); graph: the same call captured in a CUDA graph and replayed (the kernels' "
             "time); bwd = graph fwd+bwd − graph fwd. Byte floor: x0 read twice, x_t written, pred read, grad "
             "written (cases.py); the fused ops' backward moves 2 bytes per gradient byte more. Ratios use the "
             "graphed times where there are any. The latent batches fit in the L2 cache (50-60 MB on an "
             "H100/H200), so their rate can pass the HBM copy's; the pixel batch's cannot."]
    notes += [f"Not captured: {r['case']} {k}: {v}" for r in rows for k, v in r["graph_failed"].items()]
    return lines, notes


def main(argv=None) -> None:
    ap = _env.Parser(description="the diffusion math's achieved bandwidth (see the module docstring)")
    ap.add_argument("--shapes", type=shape_arg, default=shape_arg("latent-dit,latent-512,pixel"))
    ap.add_argument("--rounds", type=_env.count(), default=15, help="interleaved rounds")
    ap.add_argument("--calls", type=_env.count(), default=50, help="calls (or graph replays) back to back per round")
    ap.add_argument("--interpret", action="store_true",
                    help="on CPU also the Triton kernels in the interpreter (a check of that path, not a timing)")
    ap.add_argument("--out", type=_env.stem, default=None, help="result stem (default kernels-bandwidth-<device>)")
    args = ap.parse_args(argv)
    if args.interpret and DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (kernels/backend.py)
    ceil = ceilings(DEVICE)
    print(f"ceilings: {json.dumps(ceil)}", flush=True)
    from interleaved import graphed

    rows = []
    for name, shape in args.shapes.items():
        got = bandwidth(shape, args.rounds, args.calls, args.interpret, graphed if DEVICE == "cuda" else None)
        for r in got:
            r["case"] = name
        rows += got
        print(f"{name}: " + ", ".join(f"{r['impl']} {r['graph_us'] or r['plain_us']:.1f} us" for r in got), flush=True)
    lines, notes = table(rows, ceil["copy_GBps"], args.rounds, args.calls)
    from interleaved import write

    write(args.out or f"kernels-bandwidth-{DEVICE}", f"Diffusion math per step against the memory bandwidth ({DEVICE})",
          {"machine": machine(), "ceilings": ceil, "rounds": args.rounds, "calls": args.calls, "rows": rows},
          lines, notes)


if __name__ == "__main__":
    _env.run(main)
