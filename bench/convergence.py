"""Convergence study: steps (and seconds) to the baseline's metric at 25%, 50% and 100% of its run, for
every timestep strategy trained as its source trains it (bench/convergence_arms.py), with paired
seeds and 90% bootstrap intervals, on two domains:

  digits        the built-in 8×8 digits, unet_tiny (ch 16); FID with the project's offline digits
                extractor; batch 16 and batch 4 (the small-batch regime of the mixed-prediction paper)
  checkerboard  the built-in 2-D checkerboard, an MLP; the sliced Wasserstein-2 distance of generated
                points to fresh samples of the true density (an exact metric of the distribution)

    python bench/convergence.py                       # the study: about 90 minutes on 2 cores
    python bench/convergence.py --resume --domain digits --batches 16 \
        --arms input_perturbation,pseudo_huber_snr,immiscible                   # + the noise/loss options, ~10 min
    python bench/convergence.py --resume              # continue (finished runs are kept)
    python bench/convergence.py --resume --domain digits --batches 4 --arms mixed_snr   # a subset, added
    python bench/convergence.py --quick               # two arms, one seed, a few hundred steps (CI)

Every run is `fasttrain train` in its own process with one thread (two side by side fill the two
cores; the longest runs start first). Seeds are paired: a seed's initial weights, data order and
noise are the same in every arm. Adaptive arms get a look-ahead period short enough for ≥ 300 policy
updates in the run (the official period of 40 steps would need 12,000 steps), and their updates and
final p(t)'s total variation from uniform are reported. The combination arm is chosen by the script
at each domain's first batch size and run there: the strongest non-sampler arm with the best sampler
arm's sampler, among the arms of that invocation (an invocation with --arms chooses none, so the
noise/loss options that `--arms` adds are not candidates). Seconds per step are measured after the
grid, every arm of a table side by side in one process (interleaved rounds), because a run's own step
time depends on what ran beside it. Results: bench/results/convergence.{json,md},
convergence-digits.png, convergence-checkerboard.png, with the machine and versions; the runs under
runs/convergence/ (outside the source tree).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _env  # noqa: F401  (OpenMP's wait policy, before torch loads it)

sys.path.insert(0, str(Path(__file__).parent))
from convergence_arms import ARMS, Arm, available, combination
from convergence_lib import first_crossing, paired_median_ci, value_at

ROOT = Path(__file__).parent
RESULTS = ROOT / "results"
RUNS = ROOT.parent / "runs" / "convergence"  # training runs: outside the source tree
TARGETS = (0.25, 0.5, 1.0)
MIN_UPDATES = 300

COMMON = ["diffusion.prediction=eps", "diffusion.weighting=simple", "diffusion.sampler=uniform", "train.threads=1",
          "train.progress=false", "train.ckpt_every=0", "sample.num=0", "eval.bpd=false", "train.log_every=100",
          "diagnostics.interference_every=0", "optim.warmup_steps=200", "train.plots=false"]
# The arms each domain and batch runs by default (--arms replaces them). Digits batch 16: every arm but the
# noise/loss options (EXTRAS: `--arms` runs them, ~10 min more); batch 4, the small-batch regime: the mixed
# arms and their controls; checkerboard: the seed papers' arms. Within 100 min on 2 cores in all.
EXTRAS = ("input_perturbation", "pseudo_huber_snr", "immiscible")
SMALL_BATCH = ("baseline", "min_snr_eps", "mixed_snr", "mixed_min_snr")
TWO_D = ("baseline", "min_snr_eps", "min_snr_v", "speed", "edm2", "adaptive", "adaptive_official", "mixed_snr",
         "mixed_min_snr")
DOMAINS = {
    "digits": dict(base=COMMON + ["data.name=digits", "model.name=unet_tiny", "model.args.ch=16", "optim.lr=1e-3",
                                  "eval.steps=20"],
                   metric="fid", label="FID (digits features)", batches={16: 960, 4: 960}, seeds=5, eval_n=256,
                   arms={16: tuple(a for a in ARMS if a not in EXTRAS), 4: SMALL_BATCH}),
    "checkerboard": dict(base=COMMON + ["data.name=checkerboard", "model.name=mlp", "optim.lr=2e-3", "eval.steps=50"],
                         metric="sw2", label="sliced W2 to the true density", batches={128: 600}, seeds=10,
                         eval_n=2000, arms={128: TWO_D}),
}


def run_dir(domain: str, batch: int, arm: str, seed: int) -> Path:
    return RUNS / domain / f"b{batch}" / arm / f"seed{seed}"


def overrides(domain: str, arm: Arm, name: str, batch: int, seed: int, steps: int, evals: int) -> list[str]:
    d = DOMAINS[domain]
    over = d["base"] + list(arm.overrides) + [
        f"data.batch_size={batch}", f"train.seed={seed}", f"train.steps={steps}", f"eval.every={steps // evals}",
        f"eval.num_samples={d['eval_n']}", f"run_dir={run_dir(domain, batch, name, seed)}"]
    if arm.adaptive:  # enough policy updates to learn something: ≥ MIN_UPDATES in the run
        # (chunk: probe elements per no-grad forward; 256 was ~15% faster than 4 micro-batches (64) on one CPU thread)
        over += [f"diffusion.sampler_args.every={max(1, steps // MIN_UPDATES)}", "diffusion.sampler_args.chunk=256"]
    return over


def expected_cost(job: tuple) -> float:
    """A rough relative cost of a run, to start the longest first (two workers finish together)."""
    domain, batch, _, _, args = job
    steps = next(int(a.split("=")[1]) for a in args if a.startswith("train.steps="))
    look = 10.0 if "diffusion.sampler_args.tau_grid=0" in args else 3.0 if "diffusion.sampler=adaptive" in args else 1.0
    return steps * look * (0.3 if domain == "checkerboard" else 0.5 + batch / 32)


def launch(args: list[str], log: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log, "w") as f:
        return subprocess.run([sys.executable, "-m", "fasttrain.cli", "train"] + args, stdout=f,
                              stderr=subprocess.STDOUT, env=env).returncode


def run_grid(jobs: list[tuple], parallel: int, resume: bool) -> None:
    """jobs: (domain, batch, arm name, seed, overrides)."""
    def done(j) -> bool:  # finished, with the same overrides (a run written before they were kept counts)
        d = run_dir(*j[:4])
        kept = d.parent / f"seed{j[3]}.args.json"
        return (d / "summary.json").is_file() and (not kept.is_file() or json.loads(kept.read_text()) == list(j[4]))

    todo = sorted((j for j in jobs if not (resume and done(j))), key=expected_cost, reverse=True)
    print(f"{len(jobs) - len(todo)} runs done, {len(todo)} to go ({parallel} at a time)", flush=True)

    def one(job):
        domain, batch, arm, seed, args = job
        d = run_dir(domain, batch, arm, seed)
        if d.exists():  # an interrupted run starts over: its partial files would be refused
            shutil.rmtree(d)
        d.parent.mkdir(parents=True, exist_ok=True)
        (d.parent / f"seed{seed}.args.json").write_text(json.dumps(list(args)))
        t0 = time.time()
        rc = launch(args, d.parent / f"seed{seed}.log")
        print(f"  {domain} b{batch} {arm} seed{seed}: {'ok' if rc == 0 else f'FAILED ({rc})'} in "
              f"{time.time() - t0:.0f} s", flush=True)

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, todo))


def curve(run: Path, metric: str) -> dict | None:
    from fasttrain.logger import read_jsonl

    if not (run / "summary.json").is_file():
        return None
    ev = [r for r in read_jsonl(run / "metrics.jsonl") if r.get(f"eval/{metric}") is not None]
    return {"steps": [r["step"] for r in ev], "value": [r[f"eval/{metric}"] for r in ev],
            "agreement": [r.get("eval/digits_label_agreement") for r in ev]}


def adaptive_state(run: Path) -> dict | None:
    """Policy updates and the total variation of the final p(t) from uniform, from the run's checkpoint."""

    from fasttrain import checkpoint as ckpt
    from fasttrain import diffusion as fd

    if not (run / "last.pt").is_file():
        return None
    st = ckpt.read_plain(run)
    d = st["config"]["diffusion"]
    sched = fd.schedule(d["schedule"], d["T"], d["zero_terminal_snr"])
    args = {k: v for k, v in d["sampler_args"].items()}
    smp = fd.timestep_sampler("adaptive", sched, **args)
    smp.load_state_dict(st["objective"]["_extra_state"]["sampler"])
    p = smp.probs().double()
    return {"policy_updates": int(smp.updates), "p_tv_final": float(0.5 * (p - 1.0 / sched.T).abs().sum()),
            "p_small_t": float(p[: sched.T // 10].sum() * 10), "p_large_t": float(p[-sched.T // 10:].sum() * 10)}


def analyse(domain: str, batch: int, arms: dict[str, Arm], seeds: list[int], steps: int, cost: dict | None) -> dict:
    metric = DOMAINS[domain]["metric"]
    names = list(arms) + [a.control for a in arms.values() if a.control not in arms]  # controls: for vs_control
    curves = {a: {s: curve(run_dir(domain, batch, a, s), metric) for s in seeds} for a in names}
    out = {}
    for name, arm in arms.items():
        per_target, per_seed = {}, []
        for frac in TARGETS:
            ratios, vs_control = [], []
            for s in seeds:
                base, c, ctrl = curves["baseline"][s], curves[name][s], curves.get(arm.control, {}).get(s)
                if not (base and c and base["steps"] and c["steps"]):
                    continue
                target = value_at(frac * steps, base["steps"], base["value"])
                mine, theirs = first_crossing(c["steps"], c["value"], target), first_crossing(base["steps"],
                                                                                              base["value"], target)
                ratios.append((theirs.steps / mine.steps if not mine.censored else math.nan, mine.censored))
                if ctrl and ctrl["steps"] and arm.control != "baseline":
                    # control steps / arm steps; where the control never got there the value is a lower bound
                    # (kept: conservative), where the arm did not it is censored
                    cc = first_crossing(ctrl["steps"], ctrl["value"], target)
                    vs_control.append((cc.steps / mine.steps if not mine.censored else math.nan, mine.censored))
                if frac == 1.0:
                    per_seed.append({"seed": s, "target": target, "steps_to_target": mine.steps,
                                     "censored": mine.censored, "baseline_steps": theirs.steps,
                                     "value_at_end": value_at(base["steps"][-1], c["steps"], c["value"])})
            ci = paired_median_ci(ratios, seed=int(frac * 100))
            per_target[str(frac)] = {"ratio_median": ci["median"], "ratio_ci90": ci["ci"], "censored": ci["censored"],
                                     "seeds": ci["n"], "per_seed": [r for r, _ in ratios],
                                     "vs_control": paired_median_ci(vs_control, seed=7) if vs_control else None}
        res = {"recipe": arm.recipe, "source": arm.source, "control": arm.control, "targets": per_target,
               "seeds": len(per_seed), "per_seed": per_seed, "curves": {s: curves[name][s] for s in seeds
                                                                       if curves[name][s]},
               "ms_per_step": None if not cost or name not in cost else cost[name] * 1e3}
        if cost and name in cost and "baseline" in cost:
            res["seconds_ratio_median"] = (None if per_target["1.0"]["ratio_median"] is None else
                                           per_target["1.0"]["ratio_median"] * cost["baseline"] / cost[name])
        if arm.adaptive:
            states = [adaptive_state(run_dir(domain, batch, name, s)) for s in seeds]
            states = [x for x in states if x]
            if states:
                res["policy_updates"] = min(x["policy_updates"] for x in states)
                res["p_tv_final"] = sorted(x["p_tv_final"] for x in states)[len(states) // 2]
                res["adaptive_per_seed"] = states
        out[name] = res
    return out


def step_costs(domain: str, batch: int, arms: dict[str, Arm], steps: int, evals: int, timed: int = 60) -> dict:
    """Seconds per training step of every arm measured side by side in this process (the trainer's own
    step with the run's overrides, one thread, interleaved rounds of 15 steps: bench/throughput.py), so
    seconds compare the arms and not what ran beside each run."""
    import tempfile

    from throughput import interleaved, trainer

    with tempfile.TemporaryDirectory() as d:
        trs = {a: trainer([o for o in overrides(domain, arm, a, batch, 0, steps, evals) if not o.startswith(
            ("run_dir=", "eval."))] + ["eval.num_samples=0", "eval.every=0"], Path(d)) for a, arm in arms.items()}
        cost = interleaved(trs, timed, warmup=6, round_steps=15)
        for tr in trs.values():
            tr.close()
    return cost


def run_costs(domain: str, batch: int, arms: dict[str, Arm], seeds: list[int]) -> dict:
    """Seconds per training step of every arm: the median over its seeds of the median of the run's own
    logged step times (look-aheads included). Cheaper than step_costs but noisier: a run's step time
    depends on what ran beside it (--no-timing)."""
    import statistics

    from fasttrain.logger import read_jsonl

    cost = {}
    for a in arms:
        per_seed = []
        for s in seeds:
            m = run_dir(domain, batch, a, s) / "metrics.jsonl"
            times = [r["sec_per_step"] for r in read_jsonl(m) if r.get("sec_per_step")] if m.is_file() else []
            if times:
                per_seed.append(statistics.median(times))
        if per_seed:
            cost[a] = statistics.median(per_seed)
    return cost


def report(plan: dict, results: dict, meta: dict, out_dir: Path, t0: float, costs=None) -> None:
    """Analyse every planned table (an invocation with other arms adds to a batch's table) and write the
    outputs, with this invocation's wall time so far; `costs(domain, batch, arms, steps, seeds)` gives the
    seconds per step of a table's arms (None: no seconds)."""
    from convergence_report import write_outputs

    for domain, (batches, seeds, arms) in plan.items():
        for b, n in batches.items():
            table = results.setdefault(domain, {}).setdefault(str(b), {})
            cost = costs(domain, b, arms[b], n, seeds) if costs else None
            table.update(analyse(domain, b, arms[b], seeds, n, cost))
    walls = meta.get("walls", [])
    meta = {**meta, "wall_seconds": time.time() - t0}
    meta["walls"] = walls + [meta["wall_seconds"]]
    write_outputs(results, meta, out_dir)


def machine() -> dict:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or
            platform.machine(), "cores": os.cpu_count(), "threads_per_run": 1}


def has_key(key: str) -> bool:
    from omegaconf import OmegaConf

    from fasttrain.config import Config

    return OmegaConf.select(OmegaConf.structured(Config), key, default="__missing__") != "__missing__"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two arms, one seed, a few hundred steps (CI)")
    ap.add_argument("--resume", action="store_true", help="keep finished runs")
    ap.add_argument("--domain", default="digits,checkerboard", help="comma-separated: digits, checkerboard")
    ap.add_argument("--arms", default=None, help="comma-separated arm names (baseline is always run)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default: each domain's)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per arm (default: 5 digits, 10 checkerboard)")
    ap.add_argument("--steps", type=int, default=None, help="steps of every run (default: each batch size's)")
    ap.add_argument("--parallel", type=int, default=2, help="runs side by side (one thread each)")
    ap.add_argument("--evals", type=int, default=8, help="evaluations per run (8: the 25%% and 50%% targets fall "
                    "on evaluations)")
    ap.add_argument("--no-timing", action="store_true", help="seconds from the runs' own logged step times "
                    "instead of measuring the arms side by side after the grid (about 2 min for the whole study)")
    ap.add_argument("--out", default=None,
                    help="results folder (default bench/results; --quick: runs/convergence-quick)")
    args = ap.parse_args(argv)
    global RUNS
    t0 = time.time()
    usable = available(ARMS, has_key)
    wanted = None
    if args.arms:
        wanted = ["baseline"] + [a for a in args.arms.split(",") if a != "baseline"]
        missing = [a for a in wanted if a not in usable]
        if missing:
            sys.exit(f"convergence: unknown or unavailable arm {missing[0]!r}; choose from {', '.join(usable)}")
    domains = args.domain.split(",")
    if args.quick:
        RUNS = ROOT.parent / "runs" / "convergence-quick"
        wanted = ["baseline", "min_snr_eps"]
        domains, args.evals = ["digits"], 3
    out_dir = Path(args.out or (RUNS if args.quick else RESULTS))
    json_path = out_dir / "convergence.json"
    saved = json.loads(json_path.read_text()) if (args.resume and json_path.is_file()) else {}
    results = saved.get("results", {})
    meta = {"machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
            "min_updates": MIN_UPDATES, "targets": TARGETS, "domains": saved.get("meta", {}).get("domains", {})}
    if saved:  # every invocation that wrote into these results, with its wall time
        old = saved.get("meta", {})
        meta["commands"] = old.get("commands", [old.get("command", "")]) + [meta["command"]]
        meta["walls"] = old.get("walls", [old.get("wall_seconds", 0)])

    # 1. every (domain, batch, arm, seed) run in one pool, the longest first
    plan, jobs = {}, []
    for domain in domains:
        d = DOMAINS[domain]
        batches = {b: args.steps or n for b, n in d["batches"].items()
                   if not args.batches or str(b) in args.batches.split(",")}
        seeds = list(range(args.seeds or d["seeds"]))
        if args.quick:
            batches, seeds = {16: 300}, [0]
            d = DOMAINS[domain] = {**d, "eval_n": 128}
        arms = {b: {a: usable[a] for a in (wanted or d["arms"][b]) if a in usable} for b in batches}
        plan[domain] = (batches, seeds, arms)
        known = meta["domains"].get(domain, {})
        design = {"seeds": seeds, "evals": args.evals, "eval_n": d["eval_n"], "base": d["base"]}
        if any(known.get(k) != v for k, v in design.items()):  # saved tables of another design do not compare
            known, results[domain] = {}, {}
        for b, n in batches.items():  # nor those of a batch run for another number of steps
            if known.get("batches", {}).get(str(b)) not in (None, n):
                results.get(domain, {}).pop(str(b), None)
                known.get("arms", {}).pop(str(b), None)
        meta["domains"][domain] = {**known, "batches": {**known.get("batches", {}), **{str(b): n for b,
                                                                                       n in batches.items()}},
                                   "seeds": seeds, "evals": args.evals, "eval_n": d["eval_n"], "metric": d["label"],
                                   "base": d["base"]}
        listed = meta["domains"][domain].setdefault("arms", {})
        for b in batches:  # the arms of every invocation, in order
            listed[str(b)] = list(dict.fromkeys(listed.get(str(b), []) + list(arms[b])))
        jobs += [(domain, b, a, s, overrides(domain, arm, a, b, s, n, args.evals))
                 for b, n in batches.items() for a, arm in arms[b].items() for s in seeds]
    run_grid(jobs, args.parallel, args.resume)
    report(plan, results, {**saved.get("meta", {}), **meta}, out_dir, t0)  # nothing lost if stage 2 is cut short

    # 2. the combination arm of each domain, chosen from its first batch's arms and run at that batch
    jobs = []
    for domain, (batches, seeds, arms) in plan.items():
        if wanted or not batches:
            continue
        first, n = next(iter(batches.items()))
        combo = combination(analyse(domain, first, arms[first], seeds, n, None), arms[first])
        if not combo:  # nothing to combine this time: no stale combination either
            meta["domains"][domain].pop("combination", None)
            results.get(domain, {}).get(str(first), {}).pop("combination", None)
            continue
        arms[first]["combination"] = combo[1]
        if meta["domains"][domain].get("combination") not in (None, combo[0]):  # another choice: stale runs
            shutil.rmtree(RUNS / domain / f"b{first}" / "combination", ignore_errors=True)
        meta["domains"][domain]["combination"] = combo[0]
        listed = meta["domains"][domain]["arms"][str(first)]
        if "combination" not in listed:
            listed.append("combination")
        jobs += [(domain, first, "combination", s, overrides(domain, combo[1], "combination", first, s, n,
                                                             args.evals)) for s in seeds]
    run_grid(jobs, args.parallel, True)

    # 3. step costs side by side, analysis and outputs
    def costs(domain, b, arms, n, seeds):
        if args.no_timing:
            return run_costs(domain, b, arms, seeds)
        return step_costs(domain, b, arms, n, args.evals, timed=15 if args.quick else 60)

    report(plan, results, {**saved.get("meta", {}), **meta}, out_dir, t0, costs)
    print((out_dir / "convergence.md").read_text())


if __name__ == "__main__":
    main()
