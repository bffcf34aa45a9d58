"""`fasttrain sample` on 1 and on 2 processes (torchrun, gloo on CPU): are the images the same, bit for bit,
and how long does each take. A tiny digits run is trained first (or --ckpt names one).

    python bench/sampling_ranks.py [--n 512] [--steps 20] [--chunk 32] [--ckpt RUN]

Writes bench/results/sampling-ranks-cpu.{json,md}.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it
import numpy as np


def _run(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = _env.Parser()
    ap.add_argument("--n", type=_env.count(), default=512)
    ap.add_argument("--steps", type=_env.count(), default=20)
    ap.add_argument("--chunk", type=_env.count(), default=32)
    ap.add_argument("--ckpt", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fasttrain-ranks-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    py = [sys.executable, "-m"]
    run = args.ckpt
    if run is None:
        run = str(tmp / "run")
        _run(py + ["fasttrain.cli", "train", f"run_dir={run}", "train.steps=200", "model.args.ch=16", "sample.num=0",
                   "eval.num_samples=0", "eval.bpd=false", "train.progress=false", "train.threads=1"], env)
    flags = ["--ckpt", run, "--num-samples", str(args.n), "--steps", str(args.steps), "--chunk", str(args.chunk),
             "--solver", "ddpm"]
    times, digests = {}, {}
    for procs in (1, 2):
        out = tmp / f"p{procs}"
        launch = py + ["fasttrain.cli"] if procs == 1 else py + ["torch.distributed.run", "--standalone",
                                                                  f"--nproc_per_node={procs}", "-m", "fasttrain.cli"]
        times[procs] = _run(launch + ["sample"] + flags + ["--out", str(out), "--npz", str(tmp / f"p{procs}.npz")], env)
        with np.load(tmp / f"p{procs}.npz") as z:
            digests[procs] = hashlib.sha256(z["arr_0"].tobytes() + z["arr_1"].tobytes()).hexdigest()
        pngs = sorted(out.glob("[0-9]*.png"))
        digests[f"png{procs}"] = hashlib.sha256(b"".join(p.read_bytes() for p in pngs)).hexdigest()
    equal = digests[1] == digests[2] and digests["png1"] == digests["png2"]
    from cases import machine

    info = machine()
    res = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv), "n": args.n,
           "steps": args.steps, "chunk": args.chunk, "solver": "ddpm", "seconds": times, "images_equal": equal,
           "npz_sha256": digests[1], "note": "2 processes on a shared 2-core machine, one thread each"}
    print(f"1 process {times[1]:.1f} s, 2 processes {times[2]:.1f} s; images equal bit for bit: {equal}")
    lines = [f"# `fasttrain sample` on 1 and 2 processes ({args.n} images, DDPM {args.steps} steps, chunks of "
             f"{args.chunk})", "", f"machine: {json.dumps(info)}  ", f"when: {res['when']}  ",
             f"command: `{res['command']}`", "", "| processes | wall s (incl. start-up) | images/s |", "|---|---|---|"]
    lines += [f"| {p} | {times[p]:.1f} | {args.n / times[p]:.0f} |" for p in (1, 2)]
    lines += ["", f"The {args.n} PNGs and the ADM `.npz` (arr_0, arr_1) of the two launches are equal bit for bit: "
              f"**{equal}** (sha256 of the npz arrays {digests[1][:16]}…).",
              "", "Times include process start-up and model loading; two processes on a shared 2-core machine show "
              "no speed-up here and claim none: the point is the equality."]
    with _env.Results() as out:
        out.text("sampling-ranks-cpu.json", json.dumps(res, indent=2))
        out.text("sampling-ranks-cpu.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    _env.run(main)
