"""Immiscible Diffusion's batch assignment: the device auction (fasttrain.diffusion.immiscible.assignment)
against the exact assignment (scipy.optimize.linear_sum_assignment, what the official code runs on rank 0):
optimality gap and CPU time, side by side on the same matrices.

    python bench/immiscible.py [--seeds 3] [--reps 5] [--sizes 16,32,64,128,256] [--dims 64,256,1024,4096]

Matrices: B images against B N(0, I) draws of D = side² values, the distance as the official code computes it
(||0.1·x - 0.1·n||, L2 not squared, rounded to float16). Images: sklearn's digits in [-1, 1] resized to
side × side (pixel diffusion), or latent-like smooth fields plus white noise of about unit variance.
  gap       (ours - exact)/exact, the relative excess of the total distance
  lost      (ours - exact)/(random - exact): the share of what the exact assignment gains over a random
            pairing that the approximation gives up (random: the mean of 8 random permutations)
  time      process CPU time per call, one thread, median over --reps interleaved calls; the exact solver's
            time includes the copy to numpy and back (what a training step would pay, besides the sync)
  ops       aten ops dispatched per call (CPU profiler): on a GPU each is about one kernel launch, so this is
            the eager launch count that a CUDA graph would replay
  fp16 lost what the official code's own approximation gives up: the exact assignment of the fp16 matrix,
            scored on the same distances in float64, against the float64 optimum (same "lost" scale)
Writes bench/results/immiscible-cpu.{json,md}: this script times the CPU only (a GPU timing is still to be done).
"""
from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _env  # OpenMP's wait policy, before torch loads it
import numpy as np
import torch
import torch.nn.functional as F

from fasttrain.diffusion.immiscible import PHASES, ROUNDS, assignment, exact_assignment

VARIANTS = {"ours (defaults)": {}, "rounds=16": {"rounds": 16}, "rounds=64": {"rounds": 64}}


def images(kind: str, B: int, D: int, g: torch.Generator) -> torch.Tensor:
    side = int(round(D**0.5))
    if kind == "digits":
        from sklearn.datasets import load_digits

        x = torch.from_numpy(load_digits().images).float().div(8).sub(1)[:, None]
        x = x[torch.randint(0, len(x), (B,), generator=g)]
    else:
        lo = max(side // 8, 2)
        x = torch.randn(B, 1, lo, lo, generator=g) + 0.3 * torch.randn(B, 1, 1, 1, generator=g)
    x = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False).flatten(1)
    return x + (0.5 * torch.randn(B, D, generator=g) if kind == "latent" else 0)


def distances(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """||0.1·x_i - 0.1·n_j|| in float64 (the official code computes it in fp16: round this with .half())."""
    return torch.cdist(0.1 * x.double(), 0.1 * n.double(), compute_mode="donot_use_mm_for_euclid_dist")


def total(d: torch.Tensor, rows: torch.Tensor) -> float:
    return d.double()[torch.arange(d.shape[0]), rows].sum().item()


def cpu_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        ts.append(time.process_time() - t0)
    return statistics.median(ts)


def run(sizes, dims, seeds, reps, count_ops: bool = True) -> list[dict]:
    from cases import count_launches

    g = torch.Generator().manual_seed(0)
    rows_out = []
    for B, D in itertools.product(sizes, dims):
        per = {name: {"gap": [], "lost": [], "time": []} for name in VARIANTS}
        exact_t, rand_gap, fp16_lost = [], [], []
        for kind, _ in itertools.product(("digits", "latent"), range(seeds)):
            d64 = distances(images(kind, B, D, g), torch.randn(B, D, generator=g))
            d = d64.half()
            best = total(d, exact_assignment(d))
            best64 = total(d64, exact_assignment(d64))
            rand64 = float(np.mean([total(d64, torch.randperm(B, generator=g)) for _ in range(8)]))
            fp16_lost.append((total(d64, exact_assignment(d)) - best64) / (rand64 - best64))
            rand = float(np.mean([total(d, torch.randperm(B, generator=g)) for _ in range(8)]))
            rand_gap.append((rand - best) / best)
            for name, kw in VARIANTS.items():  # interleaved with the exact solver, on the same matrix
                ours = total(d, assignment(d, **kw))
                per[name]["gap"].append((ours - best) / best)
                per[name]["lost"].append((ours - best) / (rand - best))
                per[name]["time"].append(cpu_time(lambda kw=kw, d=d: assignment(d, **kw), reps))
            exact_t.append(cpu_time(lambda d=d: exact_assignment(d), reps))
        for name in VARIANTS:
            p = per[name]
            rows_out.append({"B": B, "D": D, "variant": name, "batches": len(p["gap"]),
                             "gap_mean": float(np.mean(p["gap"])), "gap_max": float(np.max(p["gap"])),
                             "lost_mean": float(np.mean(p["lost"])), "lost_max": float(np.max(p["lost"])),
                             "exact_share": float(np.mean(np.array(p["gap"]) <= 1e-12)),
                             "random_gap_mean": float(np.mean(rand_gap)), "fp16_lost_mean": float(np.mean(fp16_lost)),
                             "ms": 1e3 * statistics.median(p["time"]), "scipy_ms": 1e3 * statistics.median(exact_t),
                             "ops": count_launches(lambda kw=VARIANTS[name], d=d: assignment(d, **kw)) if count_ops
                             else None})
        print(f"B={B} D={D}: " + ", ".join(f"{r['variant']} gap {r['gap_mean']:.1e} lost {r['lost_mean']:.2%}"
                                           for r in rows_out[-len(VARIANTS):]), flush=True)
    return rows_out


def write(rows: list[dict], info: dict, command: str) -> None:
    ours = [r for r in rows if r["variant"] == "ours (defaults)"]
    lines = [
        "# Immiscible Diffusion: device auction vs exact assignment (SciPy), cpu", "",
        f"machine: {json.dumps(info)}  ", f"when: {time.strftime('%Y-%m-%d %H:%M:%S')}  ", f"command: `{command}`", "",
        f"Defaults: {PHASES} ε-phases × {ROUNDS} rounds, then completion and 2 exchange passes "
        "(fasttrain/diffusion/immiscible.py). Distances: ||0.1·x − 0.1·n||, L2, fp16, images (digits resized, "
        "latent-like fields) against N(0, I). **gap** = (ours − exact)/exact; **lost** = (ours − exact)/(random − "
        "exact), the share of the exact assignment's gain over a random pairing given up; **exact** = share of "
        "batches solved exactly; time = process CPU time per call, one thread (SciPy's includes the copies); "
        "**ops** = aten ops per call (≈ kernel launches on a GPU, eager); **fp16 lost** = what the official code's "
        "fp16 distances alone give up (SciPy's exact assignment of the fp16 matrix scored in float64, on the lost "
        "scale).", "",
        f"Over all {sum(r['batches'] for r in ours)} batches: mean gap "
        f"{np.mean([r['gap_mean'] for r in ours]):.2e}, worst batch {max(r['gap_max'] for r in ours):.2e}; mean lost "
        f"{np.mean([r['lost_mean'] for r in ours]):.2%}, worst batch {max(r['lost_max'] for r in ours):.2%}.", "",
        "| B | D | variant | gap mean | gap max | lost mean | lost max | exact | random gap | fp16 lost | ms (ours) "
        "| ms (SciPy) | ops |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['B']} | {r['D']} | {r['variant']} | {r['gap_mean']:.1e} | {r['gap_max']:.1e} | "
                     f"{r['lost_mean']:.2%} | {r['lost_max']:.2%} | {r['exact_share']:.0%} | "
                     f"{r['random_gap_mean']:.2%} | {r['fp16_lost_mean']:.3%} | {r['ms']:.1f} | {r['scipy_ms']:.2f} | "
                     f"{r['ops']} |")
    with _env.Results() as res:
        res.text("immiscible-cpu.json", json.dumps({"machine": info, "command": command, "rows": rows}, indent=1))
        res.text("immiscible-cpu.md", "\n".join(lines) + "\n")


def main(argv=None) -> None:
    ap = _env.Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=_env.count(), default=3, help="batches per (B, D) and image kind")
    ap.add_argument("--reps", type=_env.count(), default=5, help="timed calls per matrix")
    ap.add_argument("--sizes", type=_env.counts(2), default=[16, 32, 64, 128, 256], help="batch sizes B (>= 2)")
    ap.add_argument("--dims", type=_env.counts(), default=[64, 256, 1024, 4096], help="dimensions D")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from cases import machine

    rows = run(args.sizes, args.dims, args.seeds, args.reps)
    write(rows, machine(), " ".join(["python bench/immiscible.py", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    main()
