"""CPU threads on a shared machine: the default run, a kernel benchmark and a test module, each on a
free machine and with one core taken by a competing process that this benchmark starts itself.

    python bench/threads.py                # writes bench/results/threads-cpu.{json,md}
    python bench/threads.py --rounds 1     # a quick look

Variants (each workload runs in a fresh process, since OpenMP's wait policy is read when torch loads
libgomp): "before" = what fasttrain did first (OMP_WAIT_POLICY unset: idle threads spin; one thread
per core), the PASSIVE policy and a short spin (GOMP_SPINCOUNT) at one thread per core, "now" =
fasttrain's default (PASSIVE; train.threads=0 runs a CPU training run on one thread), and one
thread. Rounds interleave every variant, free and busy, so that other load on the machine hits them
alike; each cell is the median over rounds. The competing process is a Python
busy loop (one core). The load average before each measurement is recorded: a free-machine
measurement is only as free as the machine was.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _env import Parser, Results, count, names

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("train", "kernels", "tests")
CORES = os.cpu_count() or 1
# threads: 0 = this version's default (train.threads=0: one thread for a CPU run; torch's default for the
# kernel benchmark), else forced
VARIANTS = {"before (spin, one thread per core)": {"policy": None, "threads": CORES},
            "passive, one thread per core": {"policy": "PASSIVE", "threads": CORES},
            "short spin (GOMP_SPINCOUNT=1000), one per core": {"policy": None, "spin": "1000", "threads": CORES},
            "now: fasttrain's default (passive; train: 1 thread)": {"policy": "PASSIVE", "threads": 0},
            "1 thread (passive)": {"policy": "PASSIVE", "threads": 1}}

WORKER = r'''
import json, os, sys, time, tempfile
kind, threads, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import torch
if kind == "train":
    from fasttrain.configure import load_config
    from fasttrain.train import Trainer
    cfg = load_config("default", [f"run_dir={tempfile.mkdtemp()}", f"train.threads={threads}", "train.progress=false",
                                  "sample.num=0", "eval.num_samples=0", "eval.bpd=false"])
    tr = Trainer(cfg)
    step = tr.train_step
else:  # the kernel benchmark's latent case: the noise and loss ops, forward + backward (bench_diffusion_loss.py)
    sys.path.insert(0, "bench")
    if threads:
        torch.set_num_threads(threads)
    from cases import SHAPES, Case
    case = Case(SHAPES["latent-dit"], "cpu")
    step = case.native
for _ in range(5):
    step()
ts = []
for _ in range(steps):
    t0 = time.perf_counter()
    step()
    ts.append(time.perf_counter() - t0)
print(json.dumps({"ms": 1000 * sorted(ts)[len(ts) // 2], "threads": torch.get_num_threads()}))
'''


def _env(variant: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if variant["policy"]:
        env["OMP_WAIT_POLICY"] = variant["policy"]
    if variant.get("spin"):
        env["GOMP_SPINCOUNT"] = variant["spin"]
    return env


def measure(kind: str, variant: dict, steps: int) -> dict:
    """One fresh process: median ms per step (train, kernels), or wall seconds of a test module (tests)."""
    env = _env(variant)
    load = os.getloadavg()[0]
    if kind == "tests":
        t0 = time.perf_counter()
        if variant["threads"]:
            env["OMP_NUM_THREADS"] = str(variant["threads"])
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/diffusion/test_objective.py"],
                       cwd=ROOT, env=env, check=True, capture_output=True)
        return {"ms": 1000 * (time.perf_counter() - t0), "load": load}
    out = subprocess.run([sys.executable, "-c", WORKER, kind, str(variant["threads"]), str(steps)], cwd=ROOT, env=env,
                         check=True, capture_output=True, text=True)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "load": load}


def busy_core() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=count(), default=3)
    ap.add_argument("--steps", type=count(), default=60, help="timed steps per measurement (train, kernels)")
    ap.add_argument("--workloads", type=names(WORKLOADS, "workload"), default=list(WORKLOADS),
                    help=f"comma-separated, of {', '.join(WORKLOADS)}")
    args = ap.parse_args()
    kinds = args.workloads
    cells: dict = {}
    for r in range(args.rounds):
        for kind in kinds:
            for name, variant in VARIANTS.items():
                for load in ("free", "one core busy"):
                    competitor = busy_core() if load != "free" else None
                    try:
                        time.sleep(0.5 if competitor else 0)
                        m = measure(kind, variant, args.steps)
                    finally:
                        if competitor:
                            competitor.kill()
                            competitor.wait()
                    cells.setdefault((kind, name, load), []).append(m)
                    print(f"round {r} {kind:8s} {name:32s} {load:14s} {m['ms']:9.1f} ms (load avg {m['load']:.2f})",
                          flush=True)
    write(cells, kinds, args)


def write(cells: dict, kinds: list, args) -> None:
    med = {k: statistics.median(m["ms"] for m in v) for k, v in cells.items()}
    unit = {"train": "ms/step", "kernels": "ms/step", "tests": "ms (test module wall time)"}
    rows = ["| workload | variant | free | one core busy | busy ÷ free | free ÷ before's free |",
            "|---|---|---|---|---|---|"]
    for kind in kinds:
        base = med[(kind, next(iter(VARIANTS)), "free")]
        for name in VARIANTS:
            free, busy = med[(kind, name, "free")], med[(kind, name, "one core busy")]
            rows.append(f"| {kind} ({unit[kind]}) | {name} | {free:.1f} | {busy:.1f} | {busy / free:.2f} | "
                        f"{free / base:.2f} |")
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "python": sys.version.split()[0],
               "load_avg_at_end": os.getloadavg()[0]}
    try:
        import torch

        machine["torch"] = torch.__version__
    except ImportError:
        pass
    data = {"machine": machine, "rounds": args.rounds, "steps": args.steps,
            "cells": {" | ".join(k): v for k, v in cells.items()}, "median_ms": {" | ".join(k): v for k,
                                                                                 v in med.items()}}
    text = "\n".join(["# CPU threads on a shared machine (`python bench/threads.py`)", "",
                      f"{args.rounds} interleaved rounds; medians. train: the default preset's training step; kernels: "
                      "the noise and loss ops (native, 256×4×32², forward + backward); tests: "
                      "`pytest tests/diffusion/test_objective.py` wall time. 'one core busy': a Python busy loop "
                      "started by the benchmark. Machine: " + json.dumps(machine), ""] + rows) + "\n"
    with Results() as res:
        res.text("threads-cpu.json", json.dumps(data, indent=1))
        res.text("threads-cpu.md", text)
    print(text)


if __name__ == "__main__":
    main()
