"""Training throughput (images/s, MFU on GPUs) and the cost of the timestep machinery, side by side.

    python bench/throughput.py [--model dit_tiny] [--batch 64] [--steps 30]

Runs the same training step three ways on one model and batch: plain uniform t with unweighted MSE
and no statistics (the baseline every trainer has), the full machinery (loss-second-moment sampler,
Min-SNR weights, per-timestep statistics synced every step, the worst case), and SpeeD; reports
ms/step and the overhead ratio. Writes bench/results/throughput-<device>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from fasttrain import diffusion as fd
from fasttrain.distributed import device_peak_flops
from fasttrain.models import build_model, forward_flops

RESULTS = Path(__file__).parent / "results"


class Runner:
    def __init__(self, objective, model, opt, x0):
        self.objective, self.model, self.opt, self.x0 = objective, model, opt, x0
        self.g = torch.Generator(x0.device).manual_seed(0)

    def steps(self, n: int) -> float:
        """Seconds per step over n steps (statistics synced every step: the worst case)."""
        cuda = self.x0.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            loss, _ = self.objective(self.model, self.x0, None, self.g)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.objective.stats is not None:
                self.objective.sync_stats()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dit_tiny")
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100, help="steps per variant, in interleaved rounds of 5")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    s = fd.schedule("linear").to(dev)
    x0 = torch.randn(args.batch, args.channels, args.image_size, args.image_size, device=dev)
    variants = {
        "uniform, plain MSE, no stats": dict(weighting="simple", sampler="uniform", stats=False),
        "loss_second_moment + min_snr + stats every step": dict(weighting="min_snr", sampler="loss_second_moment",
                                                                stats=True),
        "speed sampling + speed weighting + stats": dict(weighting="speed", sampler="speed", stats=True),
    }
    runners = {}
    for name, kw in variants.items():
        torch.manual_seed(0)
        model = build_model(args.model, in_channels=args.channels, image_size=args.image_size).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        obj = fd.DiffusionObjective(s, "eps", kw["weighting"], kw["sampler"], stats=kw["stats"]).to(dev)
        runners[name] = Runner(obj, model, opt, x0)
        runners[name].steps(3)  # warm-up
    # Interleave the variants in short rounds and take medians, so that load changes on a shared
    # machine hit all of them alike.
    times = {name: [] for name in runners}
    for _ in range(max(1, args.steps // 5)):
        for name, r in runners.items():
            times[name].append(r.steps(5))
    rows = []
    for name, ts in times.items():
        sec = sorted(ts)[len(ts) // 2]
        rows.append({"variant": name, "ms_per_step": sec * 1e3, "images_per_s": args.batch / sec})
    base = rows[0]["ms_per_step"]
    flops = 3 * forward_flops(args.model, in_channels=args.channels, image_size=args.image_size) * args.batch
    peak = device_peak_flops()
    for r in rows:
        r["overhead_vs_uniform"] = r["ms_per_step"] / base - 1
        r["mfu"] = flops / (r["ms_per_step"] / 1e3) / peak if peak else None
    info = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            "device": str(dev), "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None}
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv),
           "model": args.model, "batch": args.batch, "train_gflops_per_step": flops / 1e9, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"throughput-{dev.type}.json").write_text(json.dumps(out, indent=2))
    lines = [f"# Training step, {args.model}, batch {args.batch}×{args.channels}×{args.image_size}², {dev.type}", "",
             f"machine: {json.dumps(info)}  ", f"when: {out['when']}  ", f"command: `{out['command']}`", "",
             "| variant | ms/step | images/s | overhead vs uniform | MFU |", "|---|---|---|---|---|"]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a (no GPU peak)"
        lines.append(f"| {r['variant']} | {r['ms_per_step']:.2f} | {r['images_per_s']:.0f} | "
                     f"{100 * r['overhead_vs_uniform']:+.1f}% | {mfu} |")
    (RESULTS / f"throughput-{dev.type}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
