"""fasttrain's post-hoc EMA reconstruction against EDM2's own math on the same snapshots: a fasttrain run's
RUN/phema/ snapshots reconstructed by `fasttrain.optim.posthoc` and, from the same files, by the functions
of NVlabs/edm2 `training/phema.py` (`solve_posthoc_coefficients`, then the float32 accumulation of
`reconstruct_phema.py`, before its final cast to float16). The edm2 checkout is imported from the path
given (its code is CC BY-NC-SA and is not part of this repository); this script is not run in CI.

    python bench/phema_edm2.py --edm2 /path/to/edm2          # trains a small digits run first (~1 min)
    python bench/phema_edm2.py --edm2 /path/to/edm2 --run RUN  # an existing run with phema snapshots

Results: bench/results/phema-edm2.{json,md} (machine, versions, command, the edm2 commit when the
checkout is a git work tree).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it; one-line argument errors; result writes

SIGMAS = (0.02, 0.05, 0.08, 0.1, 0.15, 0.2, 0.25)


def parse(argv=None):
    ap = _env.Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--edm2", required=True, help="an NVlabs/edm2 checkout (its training/phema.py is imported)")
    ap.add_argument("--run", default=None, help="a fasttrain run with RUN/phema/ snapshots (default: train one)")
    ap.add_argument("--steps", type=_env.count(), default=400, help="steps of the run trained when --run is not given")
    ap.add_argument("--every", type=_env.count(), default=20, help="its snapshot interval (phema.every)")
    args = ap.parse_args(argv)
    if not (Path(args.edm2) / "training" / "phema.py").is_file():
        ap.error(f"--edm2 {args.edm2}: no training/phema.py there (give the edm2 checkout's root)")
    return args


def train_run(folder: Path, steps: int, every: int) -> Path:
    from fasttrain.configure import load_config
    from fasttrain.train import train

    run = folder / "run"
    train(load_config("default", [f"run_dir={run}", f"train.steps={steps}", f"phema.every={every}", "model.args.ch=16",
                                  "train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false",
                                  "train.threads=1", "train.plots=false", "train.log_every=100"]))
    return run


def edm2_reconstruction(edm2_phema, snaps: list, sigmas) -> tuple:
    """EDM2's coefficients (solve_posthoc_coefficients over the snapshot profiles, their times in images)
    and its accumulation: out = Σ_i coef[i, j] · θ_i in float32, as reconstruct_phema.py does it."""
    import numpy as np
    import torch

    in_nimg, in_std, tensors = [], [], []
    for s in snaps:
        st = torch.load(s.path, map_location="cpu", weights_only=True)
        for k, std in enumerate(st["sigma_rels"]):
            in_nimg.append(st["images"])
            in_std.append(std)
            tensors.append(st["shadow"][f"p{k}"])
    out_nimg = max(in_nimg)
    coefs = edm2_phema.solve_posthoc_coefficients(np.array(in_nimg), np.array(in_std), out_nimg, np.array(sigmas))
    outs = []
    for j in range(len(sigmas)):
        acc = {n: torch.zeros_like(t, dtype=torch.float32) for n, t in tensors[0].items()}
        for i, t in enumerate(tensors):
            for n in acc:
                acc[n] += t[n].to(torch.float32) * coefs[i, j]  # reconstruct_phema.py: pj += pi * coefs[i, j]
        outs.append(acc)
    return coefs, outs, tensors


def main(argv=None) -> None:
    import numpy as np
    import torch

    import fasttrain
    from fasttrain.checkpoint import snapshots
    from fasttrain.optim import phema
    from fasttrain.optim.posthoc import reconstruct

    args = parse(argv)
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(args.edm2).resolve()))
    from training import phema as edm2_phema  # the checkout given on the command line

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.run) if args.run else train_run(Path(tmp), args.steps, args.every)
        snaps = snapshots.find(run)
        if not snaps:
            raise SystemExit(f"phema_edm2.py: error: no snapshots in {run}/phema (train with phema.every=N)")
        ours = reconstruct(run, SIGMAS)
        coefs, theirs, tensors = edm2_reconstruction(edm2_phema, snaps, SIGMAS)
        meta = snapshots.read_meta(snaps[-1])
        times = [float(snapshots.read_meta(s)["images"]) for s in snaps for _ in meta["sigma_rels"]]
        sig = [float(x) for _ in snaps for x in meta["sigma_rels"]]
        mine = phema.coefficients(times, sig, max(times), SIGMAS).numpy()
        rows = []
        for j, s in enumerate(SIGMAS):
            a, b = ours[j]["ema"]["shadow"], theirs[j]
            diff = max(float((a[n] - b[n]).abs().max()) for n in a)
            scale = max(float(b[n].abs().max()) for n in b)
            # float32 rounding of the accumulation: one unit of Σ_i |c_i|·|θ_i| per term, at most
            bound = max(float(sum(abs(float(coefs[i, j])) * t[n].abs() for i, t in enumerate(tensors)).max())
                        for n in b) * float(np.finfo(np.float32).eps) * len(tensors)
            rows.append({"sigma_rel": s, "coef_max_abs_diff": float(np.abs(mine[:, j] - coefs[:, j]).max()),
                         "coef_range": [float(coefs[:, j].min()), float(coefs[:, j].max())],
                         "weights_max_abs_diff": diff, "weights_max_abs": scale, "float32_bound": bound,
                         "ulps_of_max_weight": diff / float(np.spacing(np.float32(scale))),
                         "within_float32_rounding": bool(diff <= bound)})
        steps = [s.step for s in snaps]
    commit = subprocess.run(["git", "-C", args.edm2, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    info = {"machine": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
                        "fasttrain": fasttrain.__version__, "cpu": platform.processor() or platform.machine(),
                        "cores": os.cpu_count(), "loadavg_1min": round(os.getloadavg()[0], 2)},
            "when": time.strftime("%Y-%m-%d %H:%M:%S"), "command": "python bench/phema_edm2.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "edm2": {"path": str(args.edm2), "commit": commit.stdout.strip() or "not a git work tree",
                     "functions": "training/phema.py solve_posthoc_coefficients; reconstruct_phema.py's accumulation"},
            "run": {"given": args.run, "steps": steps[-1], "snapshots": steps, "tracked": meta["sigma_rels"],
                    "parameters": sum(t.numel() for t in tensors[0].values())},
            "results": rows, "seconds": round(time.time() - t0, 1)}
    md = ["# Post-hoc EMA: fasttrain's reconstruction against EDM2's phema.py on the same snapshots", "",
          f"machine: {json.dumps(info['machine'])}  ", f"when: {info['when']}  ", f"command: `{info['command']}`  ",
          f"edm2: {info['edm2']['commit']} ({info['edm2']['functions']})  ",
          f"run: {info['run']['steps']} steps of the digits default (model.args.ch=16), {len(steps)} snapshots "
          f"(profiles {info['run']['tracked']}), {info['run']['parameters']} parameters", "",
          "Coefficients: fasttrain's (optim/phema.py, float64) against EDM2's solve_posthoc_coefficients (float64). "
          "Weights: fasttrain's reconstruction (float64 accumulation, stored float32) against EDM2's float32 "
          "accumulation (before reconstruct_phema.py's cast to float16); the float32 bound is "
          "n · ε32 · max Σ|c_i||θ_i|.", "",
          "| σ_rel | coefficients max abs diff | coefficient range | weights max abs diff | max abs weight | "
          "float32 ulps of it | float32 bound | within |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['sigma_rel']:g} | {r['coef_max_abs_diff']:.2e} | [{r['coef_range'][0]:.3g}, "
                  f"{r['coef_range'][1]:.3g}] | {r['weights_max_abs_diff']:.2e} | {r['weights_max_abs']:.3g} | "
                  f"{r['ulps_of_max_weight']:.2f} | "
                  f"{r['float32_bound']:.2e} | {'yes' if r['within_float32_rounding'] else 'NO'} |")
    with _env.Results() as res:
        res.text("phema-edm2.json", json.dumps(info, indent=2))
        res.text("phema-edm2.md", "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    _env.run(main)
