"""Pilot of the convergence study (bench/convergence.py): what its runs cost and how noisy one evaluation
is, measured on this machine, and the wall time its invocations project to. Results:
bench/results/convergence-pilot.{json,md}.

    python bench/convergence_pilot.py            # about 25 minutes on a shared 2-core machine
    python bench/convergence_pilot.py --quick    # tiny horizons and few evaluations (tests)
    python bench/convergence_pilot.py --project --measure phema,align,align_random   # new arms' step times
                                                 # measured beside the baseline, then the projection
    python bench/convergence_pilot.py --project --calibrate bench/results/convergence-levers-pilot/convergence.json
                                                 # and the pace of a short invocation of this design, run here

All in this process with one thread; every cost is a ratio to a baseline step measured beside it, so
that other processes on the machine slow both alike (units: one step of the digits batch-16 baseline):
  1. the step time of every arm of every table of the full set, side by side per table, and the
     tables' baselines side by side (convergence_measure.step_costs);
  2. per domain, the baseline trained for the study's horizon without evaluations, then rounds of 15
     baseline steps and one evaluation of its final network at each candidate number of samples: the
     evaluation's cost, and over the rounds the metric's own spread at that number of samples;
  3. the start-up of a run (`fasttrain train` with one step and no evaluation) between two timings;
  4. the projection: a run costs start-up + steps × its step + (evaluations + 1) × one evaluation; an
     invocation, its runs over --parallel workers, plus its timing and noise measurements. Seconds per
     unit: this machine's, and the saved study's (bench/results/convergence.json: its wall time on a free
     machine over its runs' units), which calibrates the projection for a free machine; with --calibrate,
     also a finished invocation of the current design on this machine (a short one: a pilot), whose wall
     over its own units gives this machine's seconds per unit at the load it ran under.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it; one-line argument errors; result writes

sys.path.insert(0, str(Path(__file__).parent))
import convergence as study
from convergence_arms import ARMS, available
from convergence_design import DOMAINS, NOISE_EVALS, TARGETS, overrides
from convergence_measure import step_costs

RESULTS = Path(__file__).parent / "results"
CANDIDATES = {"digits": (256, 512, 1024), "checkerboard": (2000, 4000)}
UNIT = ("digits", 16)


def relative_costs(full: dict, timed: int) -> dict:
    """{(domain, batch): {arm: units}}: each table's arms side by side, tied together by the tables'
    baselines side by side."""
    from throughput import interleaved, trainer

    per_table = {}
    for domain, (batches, _, arms) in full.items():
        for b, n in batches.items():
            c = step_costs(domain, b, arms[b], n, 8, timed=timed)
            per_table[(domain, b)] = {a: v / c["baseline"] for a, v in c.items()}
            print(f"  steps {domain} b{b}: " + ", ".join(f"{a} {v:.2f}" for a, v in per_table[(domain, b)].items()),
                  flush=True)
    with tempfile.TemporaryDirectory() as d:
        trs = {t: trainer(_train_overrides(t[0], t[1], full[t[0]][0][t[1]]), Path(d)) for t in per_table}
        try:
            base = interleaved(trs, timed, warmup=6, round_steps=15)
        finally:
            for tr in trs.values():
                tr.close()
    return {t: {a: v * base[t] / base[UNIT] for a, v in c.items()} for t, c in per_table.items()} | {
        "unit_seconds": base[UNIT]}


def _train_overrides(domain: str, batch: int, steps: int, seed: int = 0) -> list[str]:
    return [o for o in overrides(domain, ARMS["baseline"], "baseline", batch, seed, steps, 8)
            if not o.startswith(("run_dir=", "eval."))] + ["eval.num_samples=0", "eval.every=0"]


def evaluation_costs(domain: str, batch: int, steps: int, ns, rounds: int, tmp: Path) -> dict:
    """The baseline trained for `steps`, then rounds of 15 of its steps and one evaluation at each n:
    {n: {"units": evaluation / step, "mean", "sd", "values"}} and the trained network's folder."""
    from throughput import seconds_per_step, trainer

    from fasttrain.bundle import ModelBundle
    from fasttrain.configure import load_config
    from fasttrain.generation.evaluate import EvalSettings, reference_for, run_evaluation
    from fasttrain.train import train

    run = tmp / f"{domain}-net"
    train(load_config("default", _train_overrides(domain, batch, steps) + [f"run_dir={run}"]))

    net = ModelBundle.load(run, device="cpu")
    ref = reference_for(net.cfg, net.spec)
    key = "fid" if net.spec.image_size else "sw2"
    tr = trainer(_train_overrides(domain, batch, steps), tmp)
    seconds_per_step(tr, 6)
    out = {n: {"ratios": [], "values": []} for n in ns}
    try:
        for r in range(rounds):
            for n in ns:
                step = seconds_per_step(tr, 15)
                t0 = time.perf_counter()
                s = EvalSettings(num_samples=n, steps=net.cfg.eval.steps, bpd=False, seed=10_000 + r)
                out[n]["values"].append(run_evaluation(net, s, ref)[key])
                out[n]["ratios"].append((time.perf_counter() - t0) / ((step + seconds_per_step(tr, 15)) / 2))
    finally:
        tr.close()
    res = {n: {"units": statistics.median(v["ratios"]), "mean": statistics.mean(v["values"]),
               "sd": statistics.stdev(v["values"]) if len(v["values"]) > 1 else None, "values": v["values"]}
           for n, v in out.items()}
    print(f"  evaluations {domain}: " + ", ".join(f"n={n}: {v['units']:.0f} steps, sd {v['sd']:.3g}"
                                                  for n, v in res.items()), flush=True)
    return res


def startup_cost(domain: str, batch: int, tmp: Path, reps: int) -> float:
    """A `fasttrain train` process of one step without evaluation, in baseline steps of its table."""
    from throughput import seconds_per_step, trainer

    tr = trainer(_train_overrides(domain, batch, 100), tmp)
    seconds_per_step(tr, 6)
    ratios = []
    try:
        for k in range(reps):
            before = seconds_per_step(tr, 15)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "fasttrain.cli", "train", *_train_overrides(domain, batch, 1),
                            f"run_dir={tmp / f'start-{domain}-{k}'}"], check=True, capture_output=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            wall = time.perf_counter() - t0
            ratios.append(wall / ((before + seconds_per_step(tr, 15)) / 2))
    finally:
        tr.close()
    return statistics.median(ratios)


def plan_units(plan: dict, costs: dict, evals: dict, start: dict, n_evals: int, eval_n: dict, step0: bool = True,
               null: bool = True, heldout: bool = True, parallel: int = 2) -> dict:
    """Units of an invocation: its runs (start-up, steps, evaluations), the post-hoc EMA arms' evaluations
    (convergence_phema.py: every σ_rel at the end of each main seed, then the chosen one's curve on the main
    and null seeds; no training of their own), its timing and noise measurements, and the wall at `parallel`
    workers."""
    from convergence_phema import SIGMAS

    runs = units = posthoc = 0.0
    timing = noise = 0.0
    tables = []
    for domain, (batches, seeds, arms) in plan.items():
        ev = _interp(evals[domain], eval_n[domain])["units"]  # one evaluation, in units
        for i, (b, n) in enumerate(batches.items()):
            c = costs[(domain, b)]
            per_run = start[domain] + (n_evals + step0) * ev  # besides its steps
            names = [a for a in arms[b] if not (arms[b][a] and arms[b][a].runs)]  # arms that train runs of their own
            for a in arms[b]:
                if arms[b][a] and arms[b][a].posthoc:  # sweep + curve on the main seeds, curve on the null seeds
                    posthoc += len(seeds) * ((len(SIGMAS) + n_evals - 1) + (n_evals if null else 0)) * ev
            confirm = heldout and i == 0 and DOMAINS[domain]["confirm"]  # held-out: the costliest arm, to be safe
            if "combination" in names:  # the combination costs about its costlier half
                names.remove("combination")
                names.append(max(names, key=lambda a: c.get(a, 1.0)))
            elif confirm and any(a and a.kind == "sampler" for a in arms[b].values()):
                names.append(max(names, key=lambda a: c.get(a, 1.0)))  # stage 2 will add a combination
            extra = (["baseline"] if null else []) + ([max(names, key=lambda a: c.get(a, 1.0))] if confirm else [])
            runs += len(seeds) * (len(names) + len(extra))
            tables.append(f"{domain} b{b}: {', '.join(list(arms[b]))}" + (", null" if null else "") +
                          (", held-out" if confirm else "") + f" × {len(seeds)} seeds, {n} steps")
            units += len(seeds) * sum(per_run + n * c.get(a, max(c.values())) for a in names + extra)
            timing += sum(66 * c.get(a, 1.0) for a in arms[b])
        noise += NOISE_EVALS * ev
    return {"tables": tables, "runs": int(runs), "run_units": units, "posthoc_units": posthoc,
            "timing_units": timing, "noise_units": noise, "wall_units": (units + posthoc) / parallel + timing + noise}


def previous_study(saved: dict, usable: dict) -> dict | None:
    """The saved results' plan and measured wall time, to calibrate a free machine's seconds per unit: a
    design before this one has no step-0 evaluation, null or held-out runs."""
    meta = saved.get("meta", {})
    if not meta.get("walls"):
        return None
    plan, eval_n, new = {}, {}, False
    for domain, d in meta["domains"].items():
        new = new or "design" in d
        batches = {int(b): n for b, n in d["batches"].items()}
        arms = {b: {a: usable.get(a) for a in d["arms"][str(b)]} for b in batches}
        plan[domain], eval_n[domain] = (batches, d["seeds"], arms), d["eval_n"]
    return {"plan": plan, "eval_n": eval_n, "evals": next(iter(meta["domains"].values()))["evals"], "new": new,
            "wall_seconds": sum(meta["walls"]), "commands": meta.get("commands", [])}


def calibration(saved: dict, usable: dict, costs: dict, evals: dict, start: dict) -> dict | None:
    """Seconds per unit of a finished invocation `saved` (a convergence.json of the current design): its
    measured wall time over its plan's units, each table's step costs from its own timing measurement
    where it has one (the arms' ms/step, tied to the pilot's units by its baseline), else the pilot's."""
    domains = (saved.get("meta") or {}).get("domains") or {}
    if not domains or any(d.get("design") != study.DESIGN for d in domains.values()):
        return None
    prev = previous_study(saved, usable)
    if prev is None:
        return None
    own = dict(costs)
    for domain, d in saved["meta"]["domains"].items():
        for b, info in d.get("tables", {}).items():
            ms = (info.get("timing") or {}).get("ms_per_step") or {}
            key = (domain, int(b))
            if ms.get("baseline") and key in costs:
                own[key] = {**costs[key], **{a: v / ms["baseline"] * costs[key]["baseline"] for a, v in ms.items()}}
    units = plan_units(prev["plan"], own, evals, start, prev["evals"], prev["eval_n"])
    return {**units, "wall_seconds_measured": prev["wall_seconds"], "commands": prev["commands"],
            "seconds_per_unit": prev["wall_seconds"] / units["wall_units"]}


def main(argv=None) -> None:
    ap = _env.Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny horizons and few evaluations (tests)")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ap.add_argument("--project", action="store_true", help="measure nothing: project the current design from the "
                    "measurements in OUT/convergence-pilot.json")
    ap.add_argument("--measure", type=_env.names(ARMS, "arm"), default=None, help="with --project: measure these "
                    "arms' step times on the digits batch-16 table beside its baseline first (arms the saved "
                    "measurements lack), and keep them in OUT/convergence-pilot.json")
    ap.add_argument("--calibrate", default=None,
                    help="with --project: a convergence.json of a finished invocation of the current design on this "
                    "machine (e.g. bench/convergence.py --domain digits --seeds 2 --steps 240 --evals 4): this "
                    "machine's seconds per unit from its wall time, and the projection at that pace")
    args = ap.parse_args(argv)
    if args.measure and not args.project:
        ap.error("--measure adds step times to a saved pilot: give --project too")
    if args.calibrate and not args.project:
        ap.error("--calibrate projects from a saved pilot: give --project too")
    t0 = time.time()
    usable = available(ARMS, study.has_key)
    full = study.select(study.parse(["--full"]), usable)
    default = study.select(study.parse([]), usable)
    if args.project:
        out = json.loads((Path(args.out) / "convergence-pilot.json").read_text())
        if args.measure:  # units of a digits b16 baseline step: the arms' ratios to it, measured side by side
            d = DOMAINS["digits"]
            c = step_costs("digits", 16, {a: usable[a] for a in ["baseline"] + args.measure}, d["batches"][16], 8,
                           timed=60)
            out["step_units"]["digits/16"].update({a: v / c["baseline"] for a, v in c.items() if a != "baseline"})
            out["measured_later"] = {**out.get("measured_later", {}), **{a: time.strftime("%Y-%m-%d %H:%M:%S")
                                                                          for a in args.measure}}
        costs = {tuple(k.split("/")[:1]) + (int(k.split("/")[1]),): v for k, v in out["step_units"].items()}
        evals = {dm: {int(n): v for n, v in ev.items()} for dm, ev in out["evaluation"].items()}
        out["projection"], out["unit_seconds_free"] = project(default, full, costs, evals, out["startup_units"],
                                                              out["unit_seconds_here"], usable, False)
        out.pop("calibration", None)
        if args.calibrate:
            try:
                saved = json.loads(Path(args.calibrate).read_text())
            except (OSError, ValueError) as e:
                ap.error(f"--calibrate {args.calibrate}: not a convergence.json ({type(e).__name__})")
            cal = calibration(saved, usable, costs, evals, out["startup_units"])
            if cal is None:
                ap.error(f"--calibrate {args.calibrate}: not a finished invocation of the current design "
                         f"({study.DESIGN})")
            out["calibration"] = {**cal, "source": str(args.calibrate)}
            for p in out["projection"].values():
                p["minutes_calibrated"] = p["wall_units"] * cal["seconds_per_unit"] / 60
        out["projected_by"] = " ".join(sys.argv)
        return write(out, Path(args.out))
    if args.quick:
        full = {d: ({b: 30 for b in bt}, s, {b: dict(list(a[b].items())[:2]) for b in bt})
                for d, (bt, s, a) in full.items()}
    timed, rounds, reps = (15, 2, 1) if args.quick else (60, NOISE_EVALS, 3)
    print("1. step times", flush=True)
    costs = relative_costs(full, timed)
    unit_s = costs.pop("unit_seconds")
    evals, start = {}, {}
    with tempfile.TemporaryDirectory() as d:
        for domain, (batches, _, _) in full.items():
            b, n = next(iter(batches.items()))
            print(f"2. evaluations, {domain}", flush=True)
            ev = evaluation_costs(domain, b, n, CANDIDATES[domain][:1] if args.quick else CANDIDATES[domain], rounds,
                                  Path(d))
            evals[domain] = {k: {**v, "units": v["units"] * costs[(domain, b)]["baseline"]} for k, v in ev.items()}
            print(f"3. start-up, {domain}", flush=True)
            start[domain] = startup_cost(domain, b, Path(d), reps) * costs[(domain, b)]["baseline"]
    proj, free = project(default, full, costs, evals, start, unit_s, usable, args.quick)
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": study.machine(), "package": study.package(),
           "command": " ".join(sys.argv), "load_average": _load(), "unit": "one step of the digits batch-16 baseline",
           "unit_seconds_here": unit_s, "unit_seconds_free": free,
           "step_units": {f"{d}/{b}": c for (d, b), c in costs.items()},
           "evaluation": evals, "startup_units": start, "projection": proj, "targets": TARGETS,
           "wall_seconds": time.time() - t0}
    write(out, Path(args.out))


def project(default: dict, full: dict, costs: dict, evals: dict, start: dict, unit_s: float, usable: dict,
            quick: bool) -> tuple[dict, float | None]:
    """Projected units and minutes of the default and the full invocation, here and, calibrated by the
    previous study's wall time where the committed results are of an older design, on a free machine."""
    eval_n = {dm: (min(evals[dm]) if quick else DOMAINS[dm]["eval_n"]) for dm in DOMAINS}
    proj = {"default": plan_units(default, costs, evals, start, 8, eval_n),
            "full": plan_units(full, costs, evals, start, 8, eval_n)}
    saved = RESULTS / "convergence.json"
    prev = None if quick or not saved.is_file() else previous_study(json.loads(saved.read_text()), usable)
    free = None
    if prev:
        old = plan_units(prev["plan"], costs, evals, start, prev["evals"], prev["eval_n"], step0=prev["new"],
                         null=prev["new"], heldout=prev["new"])
        free = prev["wall_seconds"] / old["wall_units"]
        proj["previous"] = {**old, "wall_seconds_measured": prev["wall_seconds"], "commands": prev["commands"]}
    for p in proj.values():
        p["minutes_here"] = p["wall_units"] * unit_s / 60
        p["minutes_free"] = None if free is None else p["wall_units"] * free / 60
    return proj, free


def _interp(ev: dict, n: int) -> dict:
    """An evaluation's cost at n samples from the measured ones (linear in n through the nearest two;
    proportional to n beyond them)."""
    ks = sorted(ev)
    lo = max([k for k in ks if k <= n], default=ks[0])
    hi = min([k for k in ks if k >= n], default=ks[-1])
    if lo == hi:
        return {"units": ev[lo]["units"] * n / lo}
    u = ev[lo]["units"] + (ev[hi]["units"] - ev[lo]["units"]) * (n - lo) / (hi - lo)
    return {"units": u}


def _load() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def write(out: dict, folder: Path) -> None:
    lines = ["# Convergence study: pilot", "", f"machine: {json.dumps(out['machine'])}  ",
             f"package: {out['package'].get('commit')}  ", f"when: {out['when']}, load average {out['load_average']} "
             f"(a shared machine: seconds here are slower than on a free one; the ratios hold)  ",
             f"command: `{out['command']}`; {out['wall_seconds'] / 60:.0f} min"
             + (f"; projection redone for the current design by `{out['projected_by']}`" if out.get("projected_by")
                else ""), "",
             f"Unit: {out['unit']}, {out['unit_seconds_here'] * 1e3:.0f} ms here"
             + (f", {out['unit_seconds_free'] * 1e3:.0f} ms-equivalent on the free machine of the previous study "
                "(its wall time over its runs' units: start-up, parallel contention and stragglers included)"
                if out["unit_seconds_free"] else "") + ".", "", "## Step times (units), each table side by side", ""]
    for t, c in out["step_units"].items():
        lines.append(f"- {t}: " + ", ".join(f"{a} {v:.2f}" for a, v in c.items()))
    lines += ["", "## One evaluation: cost and the metric's own spread at a fixed network", "",
              "| domain | samples | cost (units) | mean | sd over evaluations |", "|---|---|---|---|---|"]
    for dm, ev in out["evaluation"].items():
        for n, v in ev.items():
            lines.append(f"| {dm} | {n} | {v['units']:.0f} | {v['mean']:.4g} | "
                         f"{_sd(v['sd'])} |")
    lines += ["", "Start-up of a run (units): " + ", ".join(f"{d} {v:.0f}" for d, v in out["startup_units"].items()),
              *(["Step times measured later, beside the baseline (`--measure`): " + ", ".join(
                  f"{a} ({w})" for a, w in out["measured_later"].items())] if out.get("measured_later") else []),
              "", "## Projected wall time", ""]
    cal = out.get("calibration")
    if cal:
        lines += [f"Calibrated here: `{' '.join(cal['commands'])}` (`{cal['source']}`), {cal['runs']} runs of the "
                  f"current design on this machine, took {cal['wall_seconds_measured'] / 60:.0f} min for "
                  f"{cal['wall_units']:.0f} wall units: {cal['seconds_per_unit'] * 1e3:.0f} ms per unit at the load "
                  f"it ran under (the last column).", ""]
    lines += ["| invocation | runs | run units | post-hoc EMA evaluations (units) | timing + noise units | wall (2 "
              "workers), here | wall, free machine |" + (" wall at the calibration's pace |" if cal else ""),
              "|---|---|---|---|---|---|---|" + ("---|" if cal else "")]
    for k, p in out["projection"].items():
        free = "—" if p["minutes_free"] is None else f"{p['minutes_free']:.0f} min"
        lines.append(f"| {k} | {p['runs']} | {p['run_units']:.0f} | {p.get('posthoc_units', 0):.0f} | "
                     f"{p['timing_units'] + p['noise_units']:.0f} | {p['minutes_here']:.0f} min | {free} |"
                     + (f" {p['minutes_calibrated']:.0f} min |" if cal else ""))
    lines += ["", "Tables:"] + [f"- {k}: " + "; ".join(p["tables"]) for k, p in out["projection"].items()]
    if "previous" in out["projection"]:
        lines += ["", f"previous: the committed results' design, measured at "
                  f"{out['projection']['previous']['wall_seconds_measured'] / 60:.0f} min (the calibration of the "
                  f"free machine)."]
    with _env.Results(folder) as res:
        res.text("convergence-pilot.json", json.dumps(out, indent=1, default=str))
        res.text("convergence-pilot.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def _sd(v) -> str:
    return "—" if v is None else f"{v:.3g}"


if __name__ == "__main__":
    _env.run(main)
