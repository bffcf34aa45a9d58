"""Why immiscible assignment does not speed up digits: the coupling it makes, measured at the study's size and
at larger ones, and what the study's networks learned from it.

    python bench/immiscible_harm.py [--runs runs/convergence/digits/b16] [--batches 24] [--seeds 0-9]

Part 1, the coupling (no network). Immiscible Diffusion (Li et al. 2024) pairs the B images of a batch with B
N(0, I) draws by a linear assignment of their L2 distances (fasttrain.diffusion.immiscible.exact_assignment,
the official code's SciPy solver). Each draw stays N(0, I); what changes is which image it meets. Per image
x with assigned noise n:
  shift      ⟨n, x/|x|⟩: the noise's component along its own image (0 on average when the pairing is random).
             Since |x - n|² = |x|² + |n|² - 2⟨x, n⟩ and the sums of squares do not depend on the pairing, the
             assignment maximises Σ⟨x, n⟩: this shift is what it buys.
  shift/|x|  the same relative to the image's norm: x_t = √ᾱ x + √(1-ᾱ) n moves along the image's direction by
             √(1-ᾱ)·shift against √ᾱ·|x| from the image itself, so the ratio says how strongly the noised
             input points back at its image, at every noise level.
  cos(x_t, x) at SNR 1 (ᾱ = ½), assigned against random pairing.
  label from noise: how often the noise ALONE names its image's digit (the class whose mean direction it
             projects on most; 10% by chance). Training is class-conditional: where the noise carries the
             class, the network can learn it from there, and at sampling the noise is drawn independently of
             the asked label.
On the built-in digits (the study's data: 8 × 8 = 64 values in [-1, 1], one channel) and the same digits resized
to 16, 32 and 64 pixels a side (up to 4096 values: Stable Diffusion's 4 × 64 × 64 latent has 16 384), at batch
16 (the study's) and 128.

Part 2, the study's networks (bench/convergence.py's runs of `baseline` and `immiscible` on the same seeds:
the same initial weights, data order and noise draws). For each run's final EMA network, on batches of 16
held-out digits, at ten noise levels (the centres of ten equal timestep bins): the ε-MSE with noise drawn
independently of the images (the diffusion process the sampler integrates from N(0, I)) and with the same
draws assigned to the images as in training. And each run's end-of-run evaluation (summary.json): FID,
precision, recall, the classifier's agreement with the asked label. Paired by seed.

Writes bench/results/immiscible-harm-cpu.{json,md}.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _env  # OpenMP's wait policy, before torch loads it
import torch
from cases import machine

from fasttrain.bundle import ModelBundle
from fasttrain.data.builtin import digits
from fasttrain.diffusion.immiscible import exact_assignment

ROOT = Path(__file__).parents[1]
SIDES, BATCHES = (8, 16, 32, 64), (16, 128)
BINS = 10
METRICS = ("fid", "fid_fasttrain_digits_cnn", "precision", "recall", "digits_label_agreement")


def assign(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """n reordered so that image b meets n[rows[b]], rows the exact L2 assignment (as training pairs them)."""
    dist = torch.cdist(x.flatten(1).double(), n.flatten(1).double())
    return n[exact_assignment(dist)]


def coupling(batches: int, gen: torch.Generator) -> list[dict]:
    """Part 1: the assignment's shift along each image, per (values per image, batch size)."""
    rows = []
    for side in SIDES:
        x_all, y_all = digits(side, "train")
        u = class_directions(x_all, y_all)
        for b in BATCHES:
            shift, rel, cos_a, cos_r, hit_a, hit_r = [], [], [], [], [], []
            for _ in range(batches):
                pick = torch.randperm(len(x_all), generator=gen)[:b]
                x, y = x_all[pick].double(), y_all[pick]
                n = torch.randn(x.shape, generator=gen, dtype=torch.float64)
                na = assign(x, n)
                xf, nf, naf = x.flatten(1), n.flatten(1), na.flatten(1)
                hit_a += ((naf @ u).argmax(1) == y).tolist()
                hit_r += ((nf @ u).argmax(1) == y).tolist()
                norm = xf.norm(dim=1)
                s = (naf * xf).sum(1) / norm
                shift += s.tolist()
                rel += (s / norm).tolist()
                cos_a += _cos_snr1(xf, naf).tolist()
                cos_r += _cos_snr1(xf, nf).tolist()
            rows.append({"side": side, "values": side * side, "batch": b,
                         "shift": statistics.fmean(shift), "shift_sd": statistics.stdev(shift),
                         "shift_rel": statistics.fmean(rel), "cos_assigned": statistics.fmean(cos_a),
                         "cos_random": statistics.fmean(cos_r), "label_from_noise_assigned": statistics.fmean(hit_a),
                         "label_from_noise_random": statistics.fmean(hit_r)})
            print(f"  {rows[-1]['values']:>6} values, batch {b:>3}: shift {rows[-1]['shift']:.2f}, "
                  f"shift/|x| {rows[-1]['shift_rel']:.3f}", flush=True)
    return rows


def class_directions(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[D, 10] float64: each class's mean image minus the overall mean, as a unit vector (a nearest-direction
    classifier that reads the class from a vector: argmax over its projections)."""
    xf = x.flatten(1).double()
    mu = torch.stack([xf[y == c].mean(0) for c in range(10)]) - xf.mean(0)
    return (mu / mu.norm(dim=1, keepdim=True)).T


def _cos_snr1(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """cos(x_t, x) per row at ᾱ = ½ (SNR 1): x_t = (x + n) / √2."""
    return torch.nn.functional.cosine_similarity((x + n) / 2 ** 0.5, x, dim=1)


@torch.no_grad()
def eps_mse(bundle: ModelBundle, x: torch.Tensor, y: torch.Tensor, batches: int, seed: int) -> dict:
    """Part 2: held-out ε-MSE per timestep bin, noise independent of / assigned to the images."""
    gen = torch.Generator().manual_seed(seed)
    abar = bundle.schedule.alphas_cumprod.cpu().double()
    T = len(abar)
    out = {"independent": [], "assigned": []}
    with bundle.averaged(ema=True) as net:
        for k in range(BINS):
            t_k = int((k + 0.5) * T / BINS)
            a, s = abar[t_k].sqrt().item(), (1 - abar[t_k]).sqrt().item()
            sums = {"independent": 0.0, "assigned": 0.0}
            for _ in range(batches):
                idx = torch.randperm(len(x), generator=gen)[:16]
                x0, lab = x[idx], y[idx]
                n = torch.randn(x0.shape, generator=gen)
                for name, noise in (("independent", n), ("assigned", assign(x0, n))):
                    x_t = a * x0 + s * noise
                    t = torch.full((len(x0),), t_k, dtype=torch.long)
                    x0_hat = net.x0_hat(x_t, t, lab)
                    eps_hat = (x_t - a * x0_hat) / s
                    sums[name] += (eps_hat - noise).pow(2).mean().item()
            for name in out:
                out[name].append(sums[name] / batches)
    return out


def networks(runs: Path, seeds: list[int], batches: int) -> dict:
    """Part 2 over the seeds that both arms finished."""
    x, y = digits(8, "test")
    res = {"seeds": [], "baseline": [], "immiscible": []}
    for seed in seeds:
        dirs = {arm: runs / arm / f"seed{seed}" for arm in ("baseline", "immiscible")}
        if not all((d / "summary.json").is_file() for d in dirs.values()):
            continue
        res["seeds"].append(seed)
        for arm, d in dirs.items():
            bundle = ModelBundle.load(d, device="cpu")
            summary = json.loads((d / "summary.json").read_text())["eval"]
            res[arm].append({"eval": {m: summary.get(m) for m in METRICS},
                             "eps_mse": eps_mse(bundle, x, y, batches, seed=1000 + seed)})
        print(f"  seed {seed}: end FID {res['baseline'][-1]['eval']['fid']:.2f} (baseline) "
              f"{res['immiscible'][-1]['eval']['fid']:.2f} (immiscible)", flush=True)
    if not res["seeds"]:
        raise SystemExit(f"immiscible_harm.py: error: no seed has finished baseline and immiscible runs under {runs}")
    return res


def median(v):
    return statistics.median(v) if v else float("nan")


def markdown(out: dict) -> str:
    m = out["machine"]
    lines = ["# Immiscible assignment on digits: the coupling, and what the networks learned", "",
             f"machine: {json.dumps(m)}  ", f"when: {out['when']}  ", f"command: `{out['command']}`", "",
             "## 1. The coupling the assignment makes (no network)", "",
             "Per image x and its assigned noise n (exact L2 assignment within the batch, as training pairs them): "
             "**shift** = ⟨n, x/|x|⟩, 0 on average for a random pairing; **shift/|x|**, how far the noised input "
             "points back at its own image relative to the image (the same ratio at every noise level); cos(x_t, x) "
             "at SNR 1, assigned against random pairing; **label from noise**: how often the noise alone names its "
             "image's digit (the class whose mean direction it projects on most; 10% by chance). Digits in [-1, 1], "
             "one channel, resized.", "",
             "| values per image | batch | shift (sd) | shift/|x| | cos(x_t, x) at SNR 1: assigned / random | "
             "label from noise: assigned / random |", "|---|---|---|---|---|---|"]
    for r in out["coupling"]:
        lines.append(f"| {r['values']} | {r['batch']} | {r['shift']:.2f} ({r['shift_sd']:.2f}) | "
                     f"{r['shift_rel']:.3f} | {r['cos_assigned']:.3f} / {r['cos_random']:.3f} | "
                     f"{r['label_from_noise_assigned']:.1%} / {r['label_from_noise_random']:.1%} |")
    n = out["networks"]
    k = len(n["seeds"])
    lines += ["", f"## 2. The study's networks ({k} seeds, paired: baseline and immiscible from the same seed)", "",
              "End-of-run evaluation (summary.json): medians over seeds, and the number of seeds where immiscible "
              "is worse.", "", "| metric | baseline | immiscible | seeds where immiscible is worse |",
              "|---|---|---|---|"]
    for metric in METRICS:
        b = [r["eval"][metric] for r in n["baseline"]]
        i = [r["eval"][metric] for r in n["immiscible"]]
        if None in b or None in i:
            continue
        lower_better = metric.startswith("fid")
        worse = sum((ii > bb) if lower_better else (ii < bb) for bb, ii in zip(b, i))
        lines.append(f"| {metric} | {median(b):.3f} | {median(i):.3f} | {worse} of {k} |")
    lines += ["", "Held-out ε-MSE of the final EMA networks per timestep bin (medians over seeds), with noise drawn "
              "independently of the images (the process the sampler runs from N(0, I)) and with the same draws "
              "assigned to the images as in training:", "",
              "| t bin | baseline: independent | baseline: assigned | immiscible: independent | immiscible: assigned |",
              "|---|---|---|---|---|"]
    for b in range(BINS):
        cells = [median([r["eps_mse"][kind][b] for r in n[arm]])
                 for arm in ("baseline", "immiscible") for kind in ("independent", "assigned")]
        lines.append(f"| {b * 100}–{(b + 1) * 100} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = _env.Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=str(ROOT / "runs" / "convergence" / "digits" / "b16"),
                    help="the study's table folder holding baseline/seedS and immiscible/seedS")
    ap.add_argument("--batches", type=_env.count(), default=24, help="batches per cell (part 1) and per bin (part 2)")
    ap.add_argument("--seeds", type=_env.count(), default=10, help="seeds 0..N-1 (those both arms finished)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    runs = Path(args.runs)
    if not runs.is_dir():
        ap.error(f"--runs {runs} is not a folder (run bench/convergence.py first)")
    t0 = time.time()
    print("part 1: the coupling", flush=True)
    coup = coupling(args.batches, torch.Generator().manual_seed(0))
    print("part 2: the study's networks", flush=True)
    nets = networks(runs, list(range(args.seeds)), args.batches)
    out = {"machine": machine(),
           "when": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python", *sys.argv]),
           "wall_s": round(time.time() - t0, 1), "coupling": coup, "networks": nets}
    with _env.Results() as res:
        res.text("immiscible-harm-cpu.json", json.dumps(out, indent=1))
        res.text("immiscible-harm-cpu.md", markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    _env.run(main)
