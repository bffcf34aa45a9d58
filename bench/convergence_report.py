"""The convergence study's outputs (bench/convergence.py): convergence.json (per domain and batch: every
row's targets, medians, intervals, verdicts, censored seeds and per-seed bounds, its controls, step time
and seconds ratio; per domain the metric's noise; per table the targets, the timing measurement and
the held-out arm), convergence.md (the tables) and one figure per domain."""
from __future__ import annotations

import json
from pathlib import Path

from convergence_analysis import HELDOUT, NULL
from convergence_lib import order_statistic_rank, value_at

ARROW = {"faster": " **↑**", "slower": " ↓", None: ""}
RULE = (
    "Each cell: how many steps an arm needs to get where a typical baseline run is at 25%, 50% and 100% of the run, "
    "as the ratio (baseline steps / arm steps, > 1: faster): the median over seeds, and a distribution-free interval "
    "for that median, the k-th smallest to the k-th largest seed with k the largest such that P(Binomial(n, ½) < k) ≤ "
    "5%, which covers the median with probability ≥ 90% whatever the seeds' distribution ({cover}). Targets: the "
    "median over the baseline's runs on the main seeds of each run's metric at 25/50/100% of the run, the same for "
    "every seed and arm; the baseline's steps to them are 25/50/100% of the run by this definition. A run that never "
    "reached a target is censored: its ratio is only known to lie below a bound, and the interval takes the bound "
    "('<x': the end lies below x; 'cens.': a median or an end that the censoring leaves open). **↑**: the interval "
    "lies above 1 and above the null row's median; ↓: below both; a pure-noise arm gets an arrow with probability ≤ "
    "1 − coverage. **null**: the baseline's runs on independent seeds (s + {offset}), which did not set the targets: "
    "what no effect looks like, the targets' own noise included. **heldout**: the strongest arm, chosen on the main "
    "seeds, on the null seeds it was not chosen on. 'vs': the arm against the arms that differ from it in one knob, "
    "paired by seed (their steps / the arm's), at the 100% target. Seconds ×: the 100% median × the baseline's step "
    "time / the arm's, both from the table's one timing measurement (the ms/step column).")


def cell(t: dict | None) -> str:
    if not t:
        return "—"
    f = lambda v, sign="", bound=False: "cens." if v is None else f"{sign if bound else ''}{v:.2f}"
    med, (lo, hi), (blo, bhi) = t["median"], t["ci"], t.get("ci_bound", [False, False])
    rng = f"[{f(lo, '>', blo)}, {f(hi, '<', bhi)}]" if t.get("coverage") else "(too few seeds for an interval)"
    cens = f", {t['censored']} cens." if t["censored"] else ""
    return f"{f(med)} {rng}{ARROW[t.get('verdict')]}{cens}"


def _covers(n_seeds: list[int]) -> str:
    from convergence_lib import coverage

    parts = []
    for n in sorted(set(n_seeds)):
        k = order_statistic_rank(n)
        parts.append(f"{n} seeds: the {_nth(k)} smallest to the {_nth(k)} largest, {coverage(n, k):.1%}" if k else
                     f"{n} seeds: no 90% interval")
    return "; ".join(parts)


def _nth(k: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(k, f"{k}th")


def phrase(row: dict) -> str:
    """A row's verdict in words, from its arrows alone: what docs/convergence.md and the README say of it."""
    v = {f: row["targets"][f].get("verdict") for f in ("0.25", "0.5", "1.0")}
    pct = lambda fs: ", ".join(f"{float(f):.0%}" for f in fs)
    if not any(v.values()):
        out = "indistinguishable from the baseline at this scale"
    else:
        parts = [f"{w} to the {pct([f for f in v if v[f] == w])} target" + "s" * (list(v.values()).count(w) > 1)
                 for w in ("faster", "slower") if w in v.values()]
        rest = [f for f in v if v[f] is None]
        out = "; ".join(parts) + (f"; indistinguishable from the baseline at {pct(rest)}" if rest else "")
    vs = row["targets"]["1.0"].get("vs", {})
    for c, t in vs.items():
        w = t.get("verdict")
        out += f"; against {c}: {'indistinguishable' if w is None else w} at 100%"
    return out


def noise_line(noise: dict | None) -> str:
    if not noise:
        return "metric noise: not measured"
    s = (f"metric noise at a fixed network (the baseline's seed-0 final EMA network, batch {noise.get('batch')}, "
         f"evaluated {noise['evals']} times on {noise['eval_n']} samples with other draws): {noise['mean']:.4g} ± "
         f"{noise['sd']:.2g} (sd)")
    if noise.get("crossing_shift_steps") is not None:
        s += (f"; over the last {noise['end_interval']} steps the baseline improves by {noise['end_improvement']:.3g} "
              f"(median), so one sd of noise moves a crossing near the end by about "
              f"{noise['crossing_shift_steps']:.0f} steps")
    if noise.get("floor_mean") is not None:
        s += (f"; two independent {noise['eval_n']}-point samples of the true density are {noise['floor_mean']:.4f} "
              f"± {noise['floor_sd']:.4f} apart (the estimator's floor)")
    return s


def _package_line(meta: dict) -> str:
    pk = meta.get("packages") or []
    versions = sorted({p.get("commit", "?") + (" (modified)" if p.get("modified") else "") for p in pk})
    if not versions:
        return "package: not recorded"
    return ("package: " + versions[0] + " for every invocation" if len(versions) == 1 else
            "packages: " + ", ".join(versions) + " (the invocations ran different versions)")


def markdown(results: dict, meta: dict) -> str:
    n_seeds = [r["targets"]["1.0"]["n"] for b in results.values() for t in b.values() for r in t.values()
               if r.get("targets")]
    lines = ["# Convergence study", "", f"machine: {json.dumps(meta['machine'])}  ", f"when: {meta['when']}  ",
             _package_line(meta) + "  ",
             "commands: " + ", ".join(f"`{c}`" for c in meta.get("commands", [meta["command"]])) + "  ",
             "wall: " + " + ".join(f"{w / 60:.0f}" for w in meta.get("walls", [meta.get("wall_seconds", 0)])) + " min "
             "(per invocation)", "", RULE.format(cover=_covers(n_seeds), offset=meta.get("null_offset", 100)), ""]
    for domain, batches in results.items():
        dm = meta.get("domains", {}).get(domain, {})
        seeds = dm.get("seeds") or []
        lines += [f"## {domain}: {dm.get('metric', '')}", "",
                  f"{len(seeds)} main seeds and as many null seeds; {dm.get('evals')} evaluations per run and one at "
                  f"step 0, on {dm.get('eval_n')} samples each  ",
                  noise_line(dm.get("noise")), ""]
        for batch, rows in batches.items():
            steps = dm.get("batches", {}).get(batch) or dm.get("batches", {}).get(int(batch))
            info = dm.get("tables", {}).get(batch, {})
            tg = info.get("targets", {})
            ph = info.get("phema") or {}
            phline = ("post-hoc EMA: σ_rel " + f"{ph['chosen']:g}" + " chosen on the main seeds (median end "
                      f"{ph.get('metric', 'metric')} of each candidate: " + ", ".join(
                          f"{float(s):g} → {v:.3g}" for s, v in ph.get("median_at_end", {}).items()) + ")  "
                      if ph.get("chosen") is not None else "")
            second = next((r["second"]["metric"] for r in rows.values() if r.get("second")), None)
            lines += [f"### batch {batch} ({steps} steps)", "",
                      "targets (25/50/100%): " + " / ".join(f"{tg[k]:.4g}" for k in sorted(tg, key=float)) + "  ",
                      f"step times: {info.get('timing', {}).get('how', '—')}, {info.get('timing', {}).get('when', '')}"
                      + "  ", f"combination: {(info.get('combination') or {}).get('name', '—')}; held-out "
                      f"confirmation: {info.get('confirm') or '—'}" + ("  " if phline or second else ""),
                      *([phline] if phline else []),
                      *([f"second evaluator: {second} (the same runs and samples; its interval and arrow at the 100% "
                         f"target, and its median at the end)"] if second else []), "",
                      "| arm | recipe (source) | to 25% | to 50% | to 100% | seconds × | vs (100%) | ms/step | "
                      "metric at the end (median) | adaptive: updates, TV(p, uniform) |"
                      + (" 2nd evaluator: to 100%, at the end |" if second else ""),
                      "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if second else "")]
            for name, r in rows.items():
                t = r["targets"]
                ends = sorted(x["value_at_end"] for x in r["per_seed"] if x["value_at_end"] == x["value_at_end"])
                end = f"{ends[len(ends) // 2]:.3g}" if ends else "—"
                vs = "; ".join(f"{cell(v)} vs {c}" for c, v in t["1.0"].get("vs", {}).items()) or "—"
                ad = "—" if "policy_updates" not in r else f"{r['policy_updates']}, {r['p_tv_final']:.3f}"
                sec = "—" if r.get("seconds_ratio_median") is None else f"{r['seconds_ratio_median']:.2f}"
                ms = "—" if r.get("ms_per_step") is None else f"{r['ms_per_step']:.1f}"
                label = f"**{name}**" if name in (NULL, HELDOUT) or name.endswith("_heldout") else name
                two = ""
                if second:
                    s2 = r.get("second")
                    e2 = s2.get("value_at_end_median") if s2 else None
                    two = (f" {cell(s2['targets']['1.0'])}, {e2:.3g} |" if s2 and e2 is not None else
                           f" {cell(s2['targets']['1.0'])} |" if s2 else " — |")
                lines.append(f"| {label} | {r['recipe']} ({r['source']}) | {cell(t['0.25'])} | {cell(t['0.5'])} | "
                             f"{cell(t['1.0'])} | {sec} | {vs} | {ms} | {end} | {ad} |{two}")
            lines += ["", "Verdicts (from the arrows alone):", ""]
            lines += [f"- **{name}**: {phrase(r)}" + (f" (2nd evaluator at 100%: "
                      f"{r['second']['targets']['1.0'].get('verdict') or 'no arrow'})" if r.get("second") else "")
                      for name, r in rows.items() if name not in ("baseline", NULL)]
            lines.append("")
    return "\n".join(lines) + "\n"


def write_outputs(results: dict, meta: dict, res) -> None:
    """Every output into `res` (bench/_env.Results: staged, put in place together when the run ends)."""
    res.text("convergence.json", json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    res.text("convergence.md", markdown(results, meta))
    for domain in results:
        plot(results[domain], domain, meta.get("domains", {}).get(domain, {}).get("metric", ""),
             res.path(f"convergence-{domain}.png"))


def plot(batches: dict, domain: str, label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(batches)
    fig, ax = plt.subplots(2, len(names), figsize=(8 * len(names), 10), squeeze=False)
    for j, batch in enumerate(names):
        arms = batches[batch]
        for i, (arm, r) in enumerate(arms.items()):
            cs = list(r["curves"].values())
            if not cs:
                continue
            steps = cs[0]["steps"]
            vals = np.array([[value_at(s, c["steps"], c["value"]) for s in steps] for c in cs])
            color = f"C{i % 10}"
            ls = "-" if i < 10 else "--"
            ax[0, j].plot(steps, np.nanmedian(vals, 0), color=color, ls=ls, label=arm, lw=1.4)
            ax[0, j].fill_between(steps, np.nanmin(vals, 0), np.nanmax(vals, 0), color=color, alpha=0.08)
        ax[0, j].set(yscale="log", xlabel="training step", ylabel=label,
                     title=f"{domain}, batch {batch}: median over seeds, seed band")
        if ax[0, j].get_legend_handles_labels()[0]:
            ax[0, j].legend(fontsize=7, ncol=2)
        others = [a for a in arms if a != "baseline"]
        x = np.arange(len(others))
        for k, (frac, off) in enumerate((("0.25", -0.27), ("0.5", 0.0), ("1.0", 0.27))):
            m = np.array([_num(arms[a]["targets"][frac]["median"]) for a in others])
            lo = np.array([_num(arms[a]["targets"][frac]["ci"][0], 0.0) for a in others])  # censored: down to 0
            hi = np.array([_num(arms[a]["targets"][frac]["ci"][1]) for a in others])
            ax[1, j].bar(x + off, np.nan_to_num(m), width=0.26, color=f"C{k}", label=f"to the target at {frac}")
            ax[1, j].errorbar(x + off, np.nan_to_num(m), yerr=[np.clip(np.nan_to_num(m) - lo, 0, None),
                                                               np.clip(np.nan_to_num(hi - m), 0, None)],
                              fmt="none", ecolor="k", capsize=2, lw=0.8)
        ax[1, j].axhline(1, color="grey", ls=":")
        ax[1, j].set_xticks(x, others, rotation=35, ha="right", fontsize=8)
        ax[1, j].set(ylabel="steps ratio: baseline / arm (≥ 90% interval)", title=f"{domain}, batch {batch}: speed-up")
        ax[1, j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _num(v, default=float("nan")) -> float:
    return default if v is None else v
