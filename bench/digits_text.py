"""The text-to-image demo as a user runs it: `fasttrain train digits-text`, timed end to end (training,
the final samples and evaluation), then the trained model evaluated again at several guidance scales:
FID (digits extractor) and prompt agreement, how often the project's digit classifier reads the digit that
the prompt ("a handwritten seven") asked for. Writes bench/results/digits_text-<device>.{json,md}.

    OMP_NUM_THREADS=1 python bench/digits_text.py [--threads 1] [--guidance 1,2,4] [--steps N]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _env import Parser, Results, count
from cases import machine

RUNS = Path(__file__).parent / ".presets"


def main(argv=None) -> None:
    import torch

    ap = Parser(description="Time the digits-text preset and measure its prompt agreement.")
    ap.add_argument("--threads", type=count(), default=1, help="train.threads (default 1)")
    ap.add_argument("--guidance", default="1,2,4", help="comma-separated guidance scales to evaluate at")
    ap.add_argument("--steps", type=count(), default=None, help="train.steps (default: the preset's)")
    args = ap.parse_args(argv)
    scales = [float(g) for g in args.guidance.split(",") if g.strip()]
    run = RUNS / "digits-text"
    cmd = [sys.executable, "-m", "fasttrain.cli", "train", "digits-text", f"run_dir={run}", "train.progress=false",
           f"train.threads={args.threads}", "--restart"] + ([f"train.steps={args.steps}"] if args.steps else [])
    t0, c0 = time.time(), os.times()
    out = subprocess.run(cmd, capture_output=True, text=True)
    seconds, c1 = time.time() - t0, os.times()
    if out.returncode != 0:
        raise SystemExit(f"digits-text failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ''}")
    cpu = (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
    summary = json.loads((run / "summary.json").read_text())

    from fasttrain.bundle import ModelBundle
    from fasttrain.generation.evaluate import EvalSettings, reference_for, run_evaluation

    torch.set_num_threads(args.threads)
    b = ModelBundle.load(run, device="cpu")
    rows = []
    for g in scales:
        b.cfg.sample.guidance = g
        settings = EvalSettings(num_samples=500, steps=b.cfg.eval.steps, bpd=False)
        ev = run_evaluation(b, settings, reference_for(b.cfg, b.spec))
        rows.append({"guidance": g, "fid": ev.get("fid"), "prompt_agreement": ev.get("digits_label_agreement"),
                     "confidence": ev.get("digits_confidence")})
        print(rows[-1], flush=True)
    info = {**machine(), "threads": args.threads, "load_avg_at_end": os.getloadavg()}
    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv),
            "train_wall_seconds": seconds, "train_cpu_seconds": cpu, "steps": summary["steps"],
            "final_eval": summary.get("eval", {})}
    m, s = divmod(int(round(seconds)), 60)
    lines = ["# digits-text (`fasttrain train digits-text`, end to end), cpu", "", f"machine: {json.dumps(info)}  ",
             f"when: {meta['when']}  ", f"command: `{meta['command']}`  ",
             f"training run: {summary['steps']} steps, {m} min {s:02d} s wall, {cpu:.0f} s CPU (with its final "
             f"samples and evaluation)", "",
             "| guidance | FID (digits extractor) | prompt agreement | classifier confidence |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['guidance']:g} | {r['fid']:.2f} | {100 * r['prompt_agreement']:.0f}% | "
                     f"{r['confidence']:.3f} |")
    with Results() as res:
        res.text("digits_text-cpu.json", json.dumps({**meta, "rows": rows}, indent=2))
        res.text("digits_text-cpu.md", "\n".join(lines) + "\n")
    print("\n".join(lines))



if __name__ == "__main__":
    main()
