"""Training-step time of the default run's shapes with the native ops against the reference backend.

    python bench/step_time.py [--steps 200] [--rounds 5] [--threads 2]

The default preset's step (README: tiny UNet on a 16x1x8x8 digits batch, eps-prediction, Min-SNR-5,
uniform t, AdamW), measured through the trainer's own step function (fasttrain/step.py) on the
objective, the model and the optimizer alone, since the step is what changes between backends:
forward, loss, backward, clip, optimizer step, per-timestep statistics.
The two backends run in interleaved blocks of `--steps` steps (`--rounds` blocks each, alternating
which goes first), so that load from other processes hits both alike. Writes
bench/results/step-cpu[-<threads>thread].{json,md}.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it
import torch

sys.path.insert(0, str(Path(__file__).parent))

from cases import machine

from fasttrain import diffusion as fd
from fasttrain.data.builtin import digits
from fasttrain.models import build_model
from fasttrain.step import Generators, StepParts, train_step


class Run:
    def __init__(self, backend: str, x0: torch.Tensor, labels: torch.Tensor):
        torch.manual_seed(0)
        s = fd.schedule("linear", T=1000)
        self.objective = fd.DiffusionObjective(s, "eps", "min_snr", "uniform", backend=backend)
        self.model = build_model("unet_tiny", in_channels=1, image_size=8, num_classes=10)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.x0, self.labels = x0, labels
        self.parts = StepParts(self.model, self.objective, self.opt, Generators(torch.Generator().manual_seed(0)))
        self.i = 0

    def steps(self, n: int) -> float:
        """Seconds per step over n steps, the batch cycling through the digits."""
        B = 16
        t0 = time.perf_counter()
        for _ in range(n):
            j = (self.i * B) % (len(self.x0) - B)
            self.i += 1
            train_step(self.parts, [(self.x0[j:j + B], self.labels[j:j + B])], step=self.i)
        return (time.perf_counter() - t0) / n


def main(argv=None):
    ap = _env.Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=_env.count(), default=200)
    ap.add_argument("--rounds", type=_env.count(), default=5)
    ap.add_argument("--threads", type=_env.count(), default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    x0, labels = digits(split="train")
    runs = {b: Run(b, x0, labels) for b in ("native", "torch")}
    for r in runs.values():
        r.steps(20)  # warm
    times = {b: [] for b in runs}
    for k in range(args.rounds):
        order = list(runs) if k % 2 == 0 else list(runs)[::-1]
        for b in order:
            times[b].append(runs[b].steps(args.steps))
    med = {b: statistics.median(ts) for b, ts in times.items()}
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "command": " ".join(sys.argv),
           "steps_per_round": args.steps, "ms_per_step": {b: [t * 1e3 for t in ts] for b, ts in times.items()},
           "median_ms": {b: m * 1e3 for b, m in med.items()}, "speedup_native": med["torch"] / med["native"]}
    name = "step-cpu" + ("" if args.threads == 2 else f"-{args.threads}thread")
    lines = ["# Default run's training step: native ops vs reference backend (cpu)", "",
             f"machine: {json.dumps(out['machine'])}  ", f"when: {out['when']}  ", f"command: `{out['command']}`", "",
             "unet_tiny, batch 16×1×8×8 digits, eps / Min-SNR-5 / uniform, AdamW; "
             f"{args.rounds} interleaved rounds of {args.steps} steps per backend, {args.threads} threads", "",
             "| backend | median ms/step | rounds (ms/step) |", "|---|---|---|"]
    for b, ts in times.items():
        lines.append(f"| {b} | {med[b] * 1e3:.2f} | {', '.join(f'{t * 1e3:.2f}' for t in ts)} |")
    lines += ["", f"native is {out['speedup_native']:.2f}× the reference backend's step rate."]
    with _env.Results() as res:
        res.text(f"{name}.json", json.dumps(out, indent=2))
        res.text(f"{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
