"""Convergence benchmark: steps and seconds to the baseline's final FID for every timestep strategy,
on the built-in digits with a small UNet, at batch 16 and at batch 4 (the small-batch regime of the
mixed-prediction paper), several paired seeds per arm (the same initial weights and data order
for a seed in every arm).

    python bench/convergence.py            # the full grid (about an hour on 2 cores), then the table
    python bench/convergence.py --resume   # continue an interrupted grid (finished runs are kept)
    python bench/convergence.py --quick    # two arms, one seed, a few hundred steps (~3 minutes)

Every run is `fasttrain train` in its own process with one thread (two side by side fill the two
cores), evaluated every `--eval-every` steps with the digits FID (the project's offline extractor)
and the digit classifier's agreement with the requested label. Results: bench/results/convergence
.{json,md,png} with the machine and versions; the runs themselves under bench/.convergence/.
The "best combination" arm is chosen by the harness after the single-knob arms at batch 16: the
best weighting arm's weighting with the best sampler arm's sampler (by median steps-to-target); it
then runs at every batch size.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _env  # noqa: F401  (OpenMP's wait policy, before torch loads it)

sys.path.insert(0, str(Path(__file__).parent))
from convergence_lib import first_crossing, seconds_at, summarize, value_at  # noqa: E402

ROOT = Path(__file__).parent
RESULTS = ROOT / "results"
RUNS = ROOT / ".convergence"

# Single-knob arms against the baseline (uniform t, eps, unweighted eps-MSE). `kind` says which knob
# an arm turns, for the choice of the best combination.
ARMS = {
    "baseline": ([], "base"),
    "min_snr_eps": (["diffusion.weighting=min_snr", "diffusion.weighting_args.gamma=5"], "weighting"),
    "min_snr_v": (["diffusion.prediction=v", "diffusion.weighting=min_snr", "diffusion.weighting_args.gamma=5"],
                  "weighting"),
    "speed": (["diffusion.sampler=speed", "diffusion.weighting=speed"], "both"),
    "loss_second_moment": (["diffusion.sampler=loss_second_moment"], "sampler"),
    "logit_normal": (["diffusion.sampler=logit_normal"], "sampler"),
    "edm2_learned": (["diffusion.learned_weighting=true"], "weighting"),
    "adaptive": (["diffusion.sampler=adaptive"], "sampler"),
    "mixed": (["diffusion.prediction=mixed", "diffusion.weighting=min_snr"], "prediction"),
}
BASE = ["diffusion.prediction=eps", "diffusion.weighting=simple", "diffusion.sampler=uniform", "model.name=unet_tiny",
        "model.args.ch=16", "train.threads=1", "train.progress=false", "train.ckpt_every=0", "sample.num=0",
        "eval.bpd=false", "eval.steps=20", "train.log_every=100", "optim.lr=1e-3", "optim.warmup_steps=200"]
SETTINGS = {16: dict(steps=3000), 4: dict(steps=4000)}


def run_dir(batch: int, arm: str, seed: int) -> Path:
    return RUNS / f"b{batch}" / arm / f"seed{seed}"


def overrides(arm: str, batch: int, seed: int, steps: int, eval_every: int, eval_n: int, arms: dict) -> list[str]:
    return BASE + arms[arm][0] + [f"data.batch_size={batch}", f"train.seed={seed}", f"train.steps={steps}",
                                  f"eval.every={eval_every}", f"eval.num_samples={eval_n}",
                                  f"run_dir={run_dir(batch, arm, seed)}"]


def launch(args: list[str], log: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log, "w") as f:
        return subprocess.run([sys.executable, "-m", "fasttrain.cli", "train"] + args, stdout=f, stderr=subprocess.STDOUT,
                              env=env).returncode


def curve(run: Path) -> dict | None:
    """The run's evaluations and its training clock (evaluation time excluded) from metrics.jsonl."""
    from fasttrain.logger import read_jsonl

    summary = run / "summary.json"
    if not summary.is_file():
        return None
    rows = read_jsonl(run / "metrics.jsonl")
    ev = [r for r in rows if r.get("eval/fid") is not None]
    clock_steps, clock, prev, total = [0], [0.0], 0, 0.0
    for r in rows:
        if r.get("sec_per_step") is not None:
            total += r["sec_per_step"] * (r["step"] - prev)
            prev = r["step"]
            clock_steps.append(r["step"])
            clock.append(total)
    return {"steps": [r["step"] for r in ev], "fid": [r["eval/fid"] for r in ev],
            "agreement": [r.get("eval/digits_label_agreement") for r in ev],
            "clock_steps": clock_steps, "clock": clock}


def run_grid(jobs: list[tuple], parallel: int, resume: bool) -> None:
    todo = [j for j in jobs if not (resume and (run_dir(*j[:3]) / "summary.json").is_file())]
    print(f"{len(jobs) - len(todo)} runs done, {len(todo)} to go ({parallel} at a time)", flush=True)

    def one(job):
        batch, arm, seed, args = job
        d = run_dir(batch, arm, seed)
        if d.exists():  # an interrupted run starts over: its partial files would be refused
            import shutil

            shutil.rmtree(d)
        d.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        rc = launch(args, d.parent / f"seed{seed}.log")
        print(f"  b{batch} {arm} seed{seed}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {time.time() - t0:.0f} s",
              flush=True)

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, todo))


def step_costs(arms: dict, batch: int, steps: int) -> dict:
    """Seconds per training step of every arm, measured side by side (the trainer's own step, one
    thread, interleaved rounds: bench/throughput.py), so that the seconds-to-target compare the arms'
    costs and not the load other processes put on a shared machine while each run trained."""
    import tempfile

    from throughput import interleaved, trainer

    with tempfile.TemporaryDirectory() as d:
        trs = {a: trainer(BASE + arms[a][0] + [f"data.batch_size={batch}", "train.seed=0"], Path(d)) for a in arms}
        cost = interleaved(trs, steps, warmup=10, round_steps=25)
        for tr in trs.values():
            tr.close()
    return cost


def analyse(batch: int, arms: list[str], seeds: list[int], cost: dict | None = None) -> dict:
    """Per arm: steps and seconds to each seed's baseline final FID (ratios to the baseline), FID and
    label agreement at the baseline's last step. Seconds are steps × the arm's side-by-side step cost
    where `cost` is given, else the run's own clock (evaluations excluded)."""
    curves = {a: {s: curve(run_dir(batch, a, s)) for s in seeds} for a in arms}
    out = {}
    for arm in arms:
        steps_r, secs_r, fid_end, agree_end, per_seed = [], [], [], [], []
        for s in seeds:
            base, c = curves["baseline"][s], curves[arm][s]
            if base is None or c is None or not c["steps"] or not base["steps"]:
                continue
            target = base["fid"][-1]
            mine, theirs = first_crossing(c["steps"], c["fid"], target), first_crossing(base["steps"], base["fid"], target)
            r = mine.ratio_to(theirs)
            if cost:
                t_mine, t_base = mine.steps * cost[arm], theirs.steps * cost["baseline"]
            else:
                t_mine = seconds_at(mine.steps, c["clock_steps"], c["clock"])
                t_base = seconds_at(theirs.steps, base["clock_steps"], base["clock"])
            steps_r.append(r)
            secs_r.append((t_base / t_mine if t_mine > 0 else math.inf, r[1]))
            end = base["steps"][-1]
            fid_end.append(value_at(end, c["steps"], c["fid"]))
            agree_end.append(c["agreement"][-1])
            per_seed.append({"seed": s, "target_fid": target, "steps_to_target": mine.steps, "censored": mine.censored,
                             "ratio": r[0], "bound": r[1], "seconds_to_target": t_mine})
        out[arm] = {"steps_ratio": summarize(steps_r), "seconds_ratio": summarize(secs_r),
                    "ms_per_step": None if not cost else cost[arm] * 1e3,
                    "fid_at_end": sorted(fid_end), "agreement_at_end": agree_end, "seeds": per_seed,
                    "curves": {s: curves[arm][s] for s in seeds if curves[arm][s]}}
    return out


def best_combination(results16: dict) -> list[str] | None:
    """The best weighting arm's weighting with the best sampler arm's sampler (median steps ratio)."""
    def best(kind):
        cands = [(results16[a]["steps_ratio"]["median"], a) for a, (_, k) in ARMS.items()
                 if k == kind and a in results16 and results16[a]["steps_ratio"]["median"] == results16[a]["steps_ratio"]["median"]]
        return max(cands)[1] if cands else None

    w, s = best("weighting"), best("sampler")
    if not w or not s:
        return None
    return ARMS[w][0] + ARMS[s][0], f"{w} + {s}"


def machine() -> dict:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "threads_per_run": 1}


def write_outputs(results: dict, meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    lines = ["# Convergence on built-in digits (FID with the offline digits extractor)", "",
             f"machine: {json.dumps(meta['machine'])}  ", f"when: {meta['when']}  ", f"command: `{meta['command']}`  ",
             f"model: unet_tiny ch=16; seeds {meta['seeds']}; evaluation every {meta['eval_every']} steps on "
             f"{meta['eval_n']} samples; {meta.get('combo_note', '')}", ""]
    for batch, res in results.items():
        lines += [f"## batch {batch} ({meta['steps'][str(batch)]} steps)", "",
                  "| arm | steps-to-target × vs baseline (median, range over seeds) | ms/step | seconds-to-target × "
                  "| FID at the baseline's last step (seeds) | label agreement at the end |", "|---|---|---|---|---|---|"]
        for arm, r in res.items():
            sr, tr = r["steps_ratio"], r["seconds_ratio"]
            bound = ""
            if sr["bounds"]:
                bound = f" ({sr['bounds']} of {len(r['seeds'])} seeds never reached the target: an upper bound)"
            fids = ", ".join(f"{f:.2f}" for f in r["fid_at_end"])
            agree = ", ".join(f"{100 * a:.0f}%" for a in r["agreement_at_end"] if a is not None)
            ms = f"{r['ms_per_step']:.1f}" if r.get("ms_per_step") else "—"
            lines.append(f"| {arm} | {sr['median']:.2f} ({sr['min']:.2f}–{sr['max']:.2f}){bound} | {ms} | "
                         f"{tr['median']:.2f} | {fids} | {agree} |")
        lines.append("")
    lines += ["Ratios above 1 reach the baseline's final FID (per seed: the same seed's baseline) in fewer steps; "
              "steps-to-target is read off the FID curve, linear between evaluations. ms/step is each arm's training "
              "step measured side by side (interleaved rounds, one thread); seconds-to-target = steps × ms/step, so the "
              "seconds ratio includes each strategy's step overhead."]
    (out / "convergence.md").write_text("\n".join(lines) + "\n")
    plot(results, out / "convergence.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    batches = list(results)
    fig, ax = plt.subplots(2, len(batches), figsize=(7 * len(batches), 9), squeeze=False)
    for j, batch in enumerate(batches):
        for i, (arm, r) in enumerate(results[batch].items()):
            cs = list(r["curves"].values())
            if not cs:
                continue
            steps = cs[0]["steps"]
            fids = np.array([[value_at(s, c["steps"], c["fid"]) for s in steps] for c in cs])
            color = f"C{i % 10}"
            ax[0, j].plot(steps, np.nanmedian(fids, 0), color=color, label=arm, lw=1.5)
            ax[0, j].fill_between(steps, np.nanmin(fids, 0), np.nanmax(fids, 0), color=color, alpha=0.15)
        ax[0, j].set(yscale="log", xlabel="training step", ylabel="FID (digits features)",
                     title=f"batch {batch}: FID over training (median, seed band)")
        ax[0, j].legend(fontsize=7)
        arms = [a for a in results[batch] if a != "baseline"]
        med = [results[batch][a]["steps_ratio"]["median"] for a in arms]
        lo = [results[batch][a]["steps_ratio"]["min"] for a in arms]
        hi = [results[batch][a]["steps_ratio"]["max"] for a in arms]
        x = np.arange(len(arms))
        bars = ax[1, j].bar(x, med, color=[f"C{(i + 1) % 10}" for i in range(len(arms))])
        for bar, a in zip(bars, arms):  # hatched: some seed never reached the target (the bar is a bound)
            if results[batch][a]["steps_ratio"]["bounds"]:
                bar.set_hatch("//")
        ax[1, j].errorbar(x, med, yerr=[np.subtract(med, lo), np.subtract(hi, med)], fmt="none", ecolor="k", capsize=3)
        ax[1, j].axhline(1, color="grey", ls=":")
        ax[1, j].set_xticks(x, arms, rotation=35, ha="right", fontsize=8)
        ax[1, j].set(ylabel="steps to the baseline's final FID: baseline / arm",
                     title=f"batch {batch}: speed-up (median, seed range; hatched: a bound)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two arms, one seed, a few hundred steps (~3 minutes)")
    ap.add_argument("--resume", action="store_true", help="keep finished runs of an interrupted grid")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=2, help="runs side by side (one thread each)")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-n", type=int, default=256)
    ap.add_argument("--timing-steps", type=int, default=300, help="steps per arm of the side-by-side step-cost "
                                                                 "measurement (0 = use each run's own clock)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results; --quick: bench/.convergence-quick)")
    args = ap.parse_args(argv)
    global RUNS
    arms = dict(ARMS)
    seeds = list(range(args.seeds))
    steps = {b: s["steps"] for b, s in SETTINGS.items()}
    if args.quick:
        RUNS = ROOT / ".convergence-quick"
        arms = {"baseline": ARMS["baseline"], "min_snr_eps": ARMS["min_snr_eps"]}
        seeds, steps, args.eval_every, args.eval_n, args.timing_steps = [0], {16: 300}, 100, 128, 50
    args.out = args.out or str(RUNS if args.quick else RESULTS)
    t0 = time.time()
    results, meta = {}, {"machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
                         "seeds": seeds, "eval_every": args.eval_every, "eval_n": args.eval_n,
                         "steps": {str(b): s for b, s in steps.items()}}
    for batch in steps:
        jobs = [(batch, a, s, overrides(a, batch, s, steps[batch], args.eval_every, args.eval_n, arms))
                for a in arms for s in seeds]
        run_grid(jobs, args.parallel, args.resume)
        results[batch] = analyse(batch, list(arms), seeds)
        if batch == 16 and not args.quick and "best_combination" not in arms:
            combo = best_combination(results[16])
            if combo:
                arms["best_combination"] = (combo[0], "combo")
                meta["combo_note"] = f"best combination = {combo[1]} (chosen from the batch-16 single-knob arms)"
                jobs = [(16, "best_combination", s, overrides("best_combination", 16, s, steps[16], args.eval_every,
                                                              args.eval_n, arms)) for s in seeds]
                run_grid(jobs, args.parallel, True)
    for batch in steps:  # the arms' step costs side by side, then the tables
        if batch != 16 and "best_combination" in arms:  # the combination chosen at batch 16 runs at every batch
            jobs = [(batch, "best_combination", s, overrides("best_combination", batch, s, steps[batch], args.eval_every,
                                                             args.eval_n, arms)) for s in seeds]
            run_grid(jobs, args.parallel, True)
        cost = step_costs(arms, batch, args.timing_steps) if args.timing_steps else None
        results[batch] = analyse(batch, list(arms), seeds, cost)
    meta["wall_seconds"] = time.time() - t0
    write_outputs({str(b): r for b, r in results.items()}, meta, Path(args.out))
    print((Path(args.out) / "convergence.md").read_text())


if __name__ == "__main__":
    main()
