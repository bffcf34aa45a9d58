"""Convergence study: steps (and seconds) for every timestep strategy, trained as its source trains it
(bench/convergence_arms.py), to reach targets set by the baseline at 25%, 50% and 100% of its run, with
paired seeds, a null row and distribution-free intervals, on two domains:

  digits        the built-in 8×8 digits, unet_tiny (ch 16); FID with the project's offline digits
                extractor; batch 16, and in the full set batch 4 (the mixed-prediction paper's small batch)
  checkerboard  the built-in 2-D checkerboard, an MLP; the sliced Wasserstein-2 distance of generated
                points to held-out samples of the true density

    python bench/convergence.py            # the default study (docs/convergence.md: its time and arms)
    python bench/convergence.py --full     # every arm in every table: several hours
    python bench/convergence.py --resume   # continue (finished runs with the same overrides are kept)
    python bench/convergence.py --resume --domain digits --batches 4 --arms min_snr_v   # add arms to a table
    python bench/convergence.py --quick    # two arms, one seed, a few hundred steps (tests)

Every run is `fasttrain train` in its own process with one thread, `--parallel` side by side. Seed s has
the same initial weights, data order, noise and evaluation draws in every arm (which pairs an arm with
its controls); the baseline also runs on the null seeds s + 100. Stages:
  1. the grid: every (table, arm, seed) run and the baseline's null seeds, in one pool, longest first;
  2. the combination arm, in an invocation without --arms where the first table of a domain that makes
     claims (digits) has a sampler arm: its strongest non-sampler arm with its best sampler's sampler;
  3. the held-out confirmation: the strongest arm of that table, chosen on the main seeds, run on the
     null seeds;
  4. the metric's own noise per domain (one network evaluated several times), one timing run per table
     (all of its arms side by side in this process), the analysis (convergence_analysis.py) and the
     outputs: bench/results/convergence.{json,md}, convergence-<domain>.png, with the machine and
     versions. They replace the previous ones only when every run finished; the runs stay under
     runs/convergence/ (outside the source tree).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it; one-line argument errors; result writes

from fasttrain.errors import InvalidInput

sys.path.insert(0, str(Path(__file__).parent))
from convergence_analysis import HELDOUT, NULL, analyse_table, strongest
from convergence_analysis import row as analysis_row
from convergence_arms import ARMS, KNOBS, Arm, available, combination
from convergence_design import (
    DOMAINS,
    MIN_UPDATES,
    NOISE_EVALS,
    NULL_OFFSET,
    RUNS,
    TARGETS,
    null_seeds,
    overrides,
    run_dir,
)
from convergence_measure import crossing_shift, metric_noise, run_costs, step_costs
from convergence_phema import choose as choose_sigma
from convergence_phema import curve as phema_curve
from convergence_phema import make_curve
from convergence_report import write_outputs
from convergence_runs import Job, adaptive_summary, curve, expected_cost, run_grid

ROOT = Path(__file__).parent
RESULTS = ROOT / "results"
QUICK_RUNS = ROOT.parent / "runs" / "convergence-quick"
DESIGN = 4  # the study's design version: saved tables of another design are not added to


def parse(argv=None) -> argparse.Namespace:
    """The arguments, each checked: a bad one is a one-line error before anything is written."""
    ap = _env.Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two arms, one seed, a few hundred steps (tests)")
    ap.add_argument("--full", action="store_true", help="every arm in every table (docs/convergence.md)")
    ap.add_argument("--resume", action="store_true", help="keep finished runs and add to the saved tables")
    ap.add_argument("--domain", type=_env.names(DOMAINS, "domain"), default=",".join(DOMAINS),
                    help=f"comma-separated, of {', '.join(DOMAINS)}")
    ap.add_argument("--arms", default=None, help="comma-separated arm names (the baseline always runs)")
    ap.add_argument("--batches", type=_env.counts(), default=None, help="comma-separated batch sizes (default: each "
                    "domain's)")
    ap.add_argument("--seeds", type=_env.count(), default=None, help="main seeds per arm (default: each domain's; the "
                    f"null seeds are these + {NULL_OFFSET})")
    ap.add_argument("--steps", type=_env.count(), default=None, help="steps of every run (default: each table's)")
    ap.add_argument("--parallel", type=_env.count(), default=2, help="runs side by side (one thread each)")
    ap.add_argument("--evals", type=_env.count(), default=8, help="evaluations per run besides the one at step 0 "
                    "(8: the 25%% and 50%% targets fall on evaluations)")
    ap.add_argument("--no-timing", action="store_true", help="seconds from the runs' own logged step times "
                    "instead of one side-by-side measurement per table after the grid")
    ap.add_argument("--out", default=None, help="results folder (default bench/results; --quick: "
                    "runs/convergence-quick)")
    args = ap.parse_args(argv)
    if args.seeds is not None and args.seeds > NULL_OFFSET:
        ap.error(f"--seeds must be at most {NULL_OFFSET} (the null seeds start at {NULL_OFFSET}), got {args.seeds}")
    if args.full and args.arms:
        ap.error("--full runs every arm; give either --full or --arms")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        ap.error(f"--out {args.out} is a file; give a folder for the results")
    return args


def select(args, usable: dict[str, Arm]) -> dict:
    """{domain: (batches {b: steps}, seeds, arms {b: {name: Arm}})} for this invocation; a selection that
    matches nothing is an error (before anything is written)."""
    wanted = None
    if args.arms:
        wanted = ["baseline"] + [a for a in args.arms.split(",") if a != "baseline"]
        missing = [a for a in wanted if a not in usable]
        if missing:
            raise InvalidInput(f"--arms: unknown or unavailable arm {missing[0]!r}; choose from {', '.join(usable)}")
    plan = {}
    for domain in (["digits"] if args.quick else args.domain):
        d = DOMAINS[domain]
        if args.quick:
            batches, seeds, wanted = {16: 300}, [0], ["baseline", "min_snr_eps"]
        else:
            tables = d["full"] if (args.full or args.batches) else d["arms"]  # --batches may pick a full-set table
            batches = {b: args.steps or d["batches"][b] for b in tables if not args.batches or b in args.batches}
            seeds = list(range(args.seeds or d["seeds"]))
        for b, n in batches.items():
            if n < args.evals:
                raise InvalidInput(f"--evals {args.evals} is more than the {n} steps of {domain} batch {b}: give fewer "
                                   "evaluations or more --steps")
        arms = {b: {a: usable[a] for a in (wanted or (d["full"][b] if args.full else d["arms"].get(b, d["full"][b])))
                    if a in usable} for b in batches}
        if batches:
            plan[domain] = (batches, seeds, arms)
    if not plan:
        tables = "; ".join(f"{k}: {', '.join(map(str, d['batches']))}" for k, d in DOMAINS.items())
        raise InvalidInput(f"--domain {','.join(args.domain)} --batches {','.join(map(str, args.batches))} selects no "
                           f"table (the tables: {tables})")
    return plan


def machine() -> dict:
    import torch

    import fasttrain

    return {"python": platform.python_version(), "torch": torch.__version__, "fasttrain": fasttrain.__version__,
            "cpu": _cpu_name(), "cores": os.cpu_count(), "threads_per_run": 1}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package() -> dict:
    """The commit the package was trained from, and whether its sources differed from it."""
    import subprocess

    git = lambda *a: subprocess.run(["git", "-C", str(ROOT.parent), *a], capture_output=True, text=True)
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode:
        return {"commit": "unknown"}
    return {"commit": head.stdout.strip(), "modified": git("diff", "--quiet", "HEAD", "--", "fasttrain",
                                                              "kernels").returncode != 0}


def has_key(key: str) -> bool:
    from omegaconf import OmegaConf

    from fasttrain.config import Config

    return OmegaConf.select(OmegaConf.structured(Config), key, default="__missing__") != "__missing__"


def jobs_for(domain: str, batch: int, arms: dict[str, Arm], seeds: list[int], steps: int, evals: int, root: Path,
             eval_n: int) -> list[Job]:
    return [Job(run_dir(domain, batch, a, s, root), tuple(overrides(domain, arm, a, batch, s, steps, evals, root,
                                                                    eval_n)),
                expected_cost(domain, batch, steps, arm.overrides))
            for a, arm in arms.items() if arm.runs is None for s in seeds]  # an arm of another's runs trains none


def posthoc(domain: str, batch: int, arms: dict[str, Arm], seeds: list[int], root: Path, eval_n: int, info: dict,
            nulls: bool) -> None:
    """The post-hoc EMA's curves (convergence_phema.py) of a table's posthoc arms: σ_rel chosen once on the
    main seeds of the runs the arms evaluate (`info["phema"]`), then every run's curve with it, on the null
    seeds too with `nulls` (the held-out rows)."""
    ph = {a: arm for a, arm in arms.items() if arm.posthoc}
    if not ph:
        return
    t0 = time.time()
    metric = DOMAINS[domain]["metric"]
    if not (info.get("phema") or {}).get("chosen"):
        src = next((arm.runs for arm in ph.values() if arm.runs), "baseline")
        done = [r for s in seeds if (r := run_dir(domain, batch, src, s, root) / "summary.json").is_file()]
        if not done:  # no finished runs (a test without training): nothing to choose from
            return
        info["phema"] = {**choose_sigma([r.parent for r in done], metric, eval_n), "from": src}
    sigma = info["phema"]["chosen"]
    on = seeds + (null_seeds(seeds) if nulls else [])
    for a, arm in ph.items():
        for s in on:
            run = run_dir(domain, batch, arm.runs or a, s, root)
            if (run / "summary.json").is_file():
                make_curve(run, sigma, eval_n)
    info["phema"]["seconds"] = info["phema"].get("seconds", 0.0) + time.time() - t0


def table_arms(known: dict, batch: int, usable: dict[str, Arm]) -> dict[str, Arm]:
    """Every arm a saved table lists (this and earlier invocations), the combination rebuilt from its
    recorded overrides."""
    combo = known.get("tables", {}).get(str(batch), {}).get("combination")
    out = {}
    for a in known.get("arms", {}).get(str(batch), []):
        if a in usable:
            out[a] = usable[a]
        elif a == "combination" and combo:
            out[a] = Arm(tuple(combo["overrides"]), "combo", combo["recipe"], f"{combo['name']}, chosen by the script",
                         adaptive=combo["adaptive"], snapshots=combo.get("posthoc", False),
                         posthoc=combo.get("posthoc", False))
    return out


def arm_curve(domain: str, batch: int, name: str, arm: Arm, seed: int, root: Path, metric: str,
              sigma: float | None) -> dict | None:
    """A run's curve: its own evaluations, or for a post-hoc EMA arm its runs' reconstructions with `sigma`."""
    run = run_dir(domain, batch, arm.runs or name, seed, root)
    if arm.posthoc:
        return phema_curve(run, sigma, metric) if sigma is not None else None
    return curve(run, metric)


def table(domain: str, batch: int, arms: dict[str, Arm], seeds: list[int], steps: int, root: Path,
          confirm: str | None, sigma: float | None = None, metric: str | None = None) -> tuple[dict, dict]:
    """A table's rows and its targets, from the runs on disk (`metric`: the domain's, or its second
    evaluator's); post-hoc EMA arms with the σ_rel `sigma` chosen on the main seeds, each with its own
    held-out row on the null seeds (`<arm>_heldout`, against the fixed EMA of the same runs)."""
    metric = metric or DOMAINS[domain]["metric"]
    nulls = null_seeds(seeds)
    def of(a):  # a control outside the table is a registered arm
        return arms.get(a) or ARMS[a]

    names = set(arms) | {c for a in arms.values() for c in a.controls}
    curves = {a: {s: arm_curve(domain, batch, a, of(a), s, root, metric, sigma) for s in seeds} for a in names}
    curves.setdefault("baseline", {}).update({h: curve(run_dir(domain, batch, "baseline", h, root), metric)
                                              for h in nulls})
    if confirm:
        curves.setdefault(confirm, {}).update({h: arm_curve(domain, batch, confirm, of(confirm), h, root, metric,
                                                            sigma) for h in nulls})
    rows, info = analyse_table(curves, arms, seeds, nulls, steps, TARGETS, confirm)
    held = {}
    for name, arm in arms.items():  # the post-hoc EMA's σ_rel was chosen on the main seeds: confirmed on the nulls
        if arm.posthoc and arm.runs and name != confirm:
            mine = {h: arm_curve(domain, batch, name, arm, h, root, metric, sigma) for h in nulls}
            ctrl = {"baseline": {h: curves["baseline"].get(h) for h in nulls}}
            rows[f"{name}_heldout"] = analysis_row(mine, info["targets"], steps, rows[NULL]["targets"], ctrl)
            held[f"{name}_heldout"] = (name, mine)
    for name, r in rows.items():
        arm = arms.get(name) or (arms[confirm] if name == HELDOUT else arms[held[name][0]] if name in held
                                 else ARMS["baseline"])
        r["recipe"], r["source"] = arm.recipe, arm.source
        r["controls"] = [c for c in arm.controls if c in curves]
        on = nulls if name in (NULL, HELDOUT) or name in held else seeds
        key = confirm if name == HELDOUT else "baseline" if name == NULL else name
        r["curves"] = ({s: c for s, c in held[name][1].items() if c} if name in held else
                       {s: c for s in on if (c := curves.get(key, {}).get(s))})
        if arm.adaptive:
            r.update(adaptive_summary([run_dir(domain, batch, arm.runs or key, s, root) for s in on]))
        if arm.posthoc:
            r["sigma_rel"] = sigma
    rows[NULL]["recipe"] = f"the baseline on the null seeds (s + {NULL_OFFSET}), which did not set the targets"
    rows[NULL]["source"] = "no effect"
    if confirm:
        rows[HELDOUT]["recipe"] = f"{confirm}, chosen as the strongest on the main seeds, on the null seeds"
    for name, (base, _) in held.items():
        rows[name]["recipe"] = f"{base} with σ_rel {sigma}, chosen on the main seeds, on the null seeds"
    return rows, info


def attach_second(rows: dict, second: dict, metric: str) -> None:
    """The second evaluator's verdicts beside the first's: per row its median, interval and arrow at each
    target, and its median value at the end (the same runs, FID in another network's features)."""
    for name, r in rows.items():
        s = second.get(name)
        if not s:
            continue
        ends = sorted(x["value_at_end"] for x in s["per_seed"] if x["value_at_end"] == x["value_at_end"])
        r["second"] = {"metric": metric, "value_at_end_median": ends[len(ends) // 2] if ends else None,
                       "targets": {f: {k: t[k] for k in ("median", "ci", "ci_bound", "censored", "coverage",
                                                          "verdict", "n") if k in t} for f, t in s["targets"].items()}}


def attach_costs(rows: dict, cost: dict, confirm: str | None) -> None:
    """ms per step and the seconds ratio (the last target's median × baseline / arm step time), both from
    the one measurement `cost` of the table."""
    base = cost.get("baseline")
    for name, r in rows.items():
        key = confirm if name == HELDOUT else "baseline" if name == NULL else name
        key = key[:-len("_heldout")] if key.endswith("_heldout") else key  # a post-hoc arm's own held-out row
        ms = cost.get(key)
        r["ms_per_step"] = None if ms is None else ms * 1e3
        med = r["targets"][str(TARGETS[-1])]["median"]
        r["seconds_ratio_median"] = None if (med is None or ms is None or base is None) else med * base / ms


def main(argv=None) -> None:
    args = parse(argv)
    t0 = time.time()
    usable = available(ARMS, has_key)
    plan = select(args, usable)
    if args.quick:
        args.evals = 3
    root = QUICK_RUNS if args.quick else RUNS
    out_dir = Path(args.out or (QUICK_RUNS if args.quick else RESULTS))
    json_path = out_dir / "convergence.json"
    saved = json.loads(json_path.read_text()) if (args.resume and json_path.is_file()) else {}
    if any(d.get("design") != DESIGN for d in saved.get("meta", {}).get("domains", {}).values()):
        saved = {}  # results of another design: nothing in them to add to, their history included
    results = saved.get("results", {})
    old = saved.get("meta", {})
    meta = {**old, "machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
            "min_updates": MIN_UPDATES, "targets": TARGETS, "null_offset": NULL_OFFSET,
            "domains": old.get("domains", {}), "commands": (old.get("commands", []) if saved else []) +
            [" ".join(sys.argv)], "walls": old.get("walls", []) if saved else [],
            "packages": (old.get("packages", []) if saved else []) + [package()]}

    # 1. every (table, arm, seed) run and the baseline's null seeds in one pool, the longest first
    jobs, eval_n = [], {}
    for domain, (batches, seeds, arms) in plan.items():
        d = DOMAINS[domain]
        eval_n[domain] = 128 if args.quick else d["eval_n"]
        known = meta["domains"].get(domain, {})
        design = {"design": DESIGN, "seeds": seeds, "evals": args.evals, "eval_n": eval_n[domain], "base": d["base"]}
        if any(known.get(k) != v for k, v in design.items()):  # saved tables of another design do not compare
            known, results[domain] = {}, {}
        for b, n in batches.items():  # nor those of a batch run for another number of steps
            if known.get("batches", {}).get(str(b)) not in (None, n):
                results.get(domain, {}).pop(str(b), None)
                known.get("arms", {}).pop(str(b), None)
                known.get("tables", {}).pop(str(b), None)
        known = meta["domains"][domain] = {**known, **design, "metric": d["label"],
                                           "batches": {**known.get("batches", {}), **{str(b): n for b, n in
                                                                                      batches.items()}}}
        listed = known.setdefault("arms", {})
        for b, n in batches.items():  # the arms of every invocation, in order
            listed[str(b)] = list(dict.fromkeys(listed.get(str(b), []) + list(arms[b])))
            jobs += jobs_for(domain, b, arms[b], seeds, n, args.evals, root, eval_n[domain])
            jobs += jobs_for(domain, b, {"baseline": ARMS["baseline"]}, null_seeds(seeds), n, args.evals, root,
                             eval_n[domain])
    failed = run_grid(jobs, args.parallel, args.resume)

    # 1b. the post-hoc EMA arms: σ_rel chosen on each table's main seeds, the curves with it (main and null seeds)
    for domain, (batches, seeds, _) in plan.items():
        for b in batches:
            info = meta["domains"][domain].setdefault("tables", {}).setdefault(str(b), {})
            posthoc(domain, b, table_arms(meta["domains"][domain], b, usable), seeds, root, eval_n[domain], info, True)

    # 2. the combination arm of each domain's first table (chosen from its rows), and
    # 3. the strongest arm of that table on the null seeds
    for domain, (batches, seeds, _) in plan.items():
        first, n = next(iter(batches.items()))
        known = meta["domains"][domain]
        info = known.setdefault("tables", {}).setdefault(str(first), {})
        every = table_arms(known, first, usable)
        if not DOMAINS[domain]["confirm"]:
            continue
        sigma = (info.get("phema") or {}).get("chosen")
        if not args.arms and not args.quick:
            rows, _ = table(domain, first, every, seeds, n, root, None, sigma)
            combo = combination(rows, every)
            old = (info.pop("combination", None) or {}).get("name")
            if not combo:  # nothing to combine this time: no stale combination either
                known["arms"][str(first)] = [a for a in known["arms"][str(first)] if a != "combination"]
                every.pop("combination", None)
            else:
                if old not in (None, combo[0]):  # another choice: its old runs are stale
                    shutil.rmtree(root / domain / f"b{first}" / "combination", ignore_errors=True)
                info["combination"] = {"name": combo[0], "overrides": list(combo[1].overrides),
                                       "recipe": combo[1].recipe, "adaptive": combo[1].adaptive,
                                       "posthoc": combo[1].posthoc}
                known["arms"][str(first)] = list(dict.fromkeys(known["arms"][str(first)] + ["combination"]))
                every["combination"] = combo[1]
                failed += run_grid(jobs_for(domain, first, {"combination": combo[1]}, seeds, n, args.evals, root,
                                            eval_n[domain]), args.parallel, True)
                posthoc(domain, first, {"combination": combo[1]}, seeds, root, eval_n[domain], info, False)
        rows, _ = table(domain, first, every, seeds, n, root, None, sigma)
        best = strongest(rows, [a for a, arm in every.items() if arm.kind in KNOBS])
        info["confirm"] = best
        if best:
            failed += run_grid(jobs_for(domain, first, {best: every[best]}, null_seeds(seeds), n, args.evals, root,
                                        eval_n[domain]), args.parallel, True)
            if every[best].posthoc:
                posthoc(domain, first, {best: every[best]}, null_seeds(seeds), root, eval_n[domain], info, False)
    if failed:  # not the user's to fix by an argument: no UserError, but one line all the same
        sys.exit(f"convergence: {len(failed)} runs failed (first: {failed[0].label}, log beside it); the results in "
                 f"{out_dir} are unchanged; fix and continue with --resume")

    # 4. the metric's noise per domain, one timing run per table, the analysis and the outputs
    for domain, (batches, seeds, _) in plan.items():
        first, n = next(iter(batches.items()))
        known = meta["domains"][domain]
        net = run_dir(domain, first, "baseline", seeds[0], root)
        if (net / "last.pt").is_file():
            noise = metric_noise(net, eval_n[domain], 3 if args.quick else NOISE_EVALS)
            base = [curve(run_dir(domain, first, "baseline", s, root), DOMAINS[domain]["metric"])
                    for s in seeds + null_seeds(seeds)]
            known["noise"] = {**noise, **crossing_shift(noise, base, n), "batch": first}
        for b, n in batches.items():
            every = table_arms(known, b, usable)
            info = known.setdefault("tables", {}).setdefault(str(b), {})
            confirm = info.get("confirm") if b == first else None
            sigma = (info.get("phema") or {}).get("chosen")
            rows, found = table(domain, b, every, seeds, n, root, confirm, sigma)
            if DOMAINS[domain].get("metric2"):  # the second evaluator's verdicts, from the same runs
                m2 = DOMAINS[domain]["metric2"]
                attach_second(rows, table(domain, b, every, seeds, n, root, confirm, sigma, metric=m2)[0], m2)
            if args.no_timing:
                cost = run_costs({a: [run_dir(domain, b, arm.runs or a, s, root) for s in seeds]
                                  for a, arm in every.items()})
                how = "the median of the runs' own logged step times (--no-timing)"
            else:
                cost = step_costs(domain, b, every, n, args.evals, timed=15 if args.quick else 60)
                how = "one measurement of every arm side by side after the grid (interleaved rounds, one thread)"
            attach_costs(rows, cost, confirm)
            info.update(found, timing={"how": how, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                                       "ms_per_step": {a: c * 1e3 for a, c in cost.items()}})
            results.setdefault(domain, {})[str(b)] = rows
    meta["wall_seconds"] = time.time() - t0
    meta["walls"] = meta["walls"] + [meta["wall_seconds"]]
    with _env.Results(out_dir) as res:  # in place only once every file is written
        write_outputs(results, meta, res)
    print((out_dir / "convergence.md").read_text())


if __name__ == "__main__":
    _env.run(main)
