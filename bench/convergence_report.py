"""The convergence study's outputs (bench/convergence.py): convergence.json (per domain, batch and arm:
seeds, the median steps ratio and its 90% paired bootstrap interval per target, censored seeds, the
adaptive arms' policy updates and p(t) drift), convergence.md (the tables) and one figure per domain."""
from __future__ import annotations

import json
from pathlib import Path

from convergence_lib import value_at


def _ratio(t: dict) -> str:
    med, (lo, hi) = t["ratio_median"], t["ratio_ci90"]
    f = lambda v: "cens." if v is None else f"{v:.2f}"
    mark = " **↑**" if lo is not None and lo > 1 else (" ↓" if hi is not None and hi < 1 else "")
    cens = f", {t['censored']} cens." if t["censored"] else ""
    return f"{f(med)} [{f(lo)}, {f(hi)}]{mark}{cens}"


def write_outputs(results: dict, meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    lines = ["# Convergence study", "", f"machine: {json.dumps(meta['machine'])}  ", f"when: {meta['when']}  ",
             "commands: " + ", ".join(f"`{c}`" for c in meta.get("commands", [meta["command"]])) + "  ",
             "wall: " + " + ".join(f"{w / 60:.0f}" for w in meta.get("walls", [meta.get("wall_seconds", 0)])) + " min "
             "(per invocation)", "",
             "Each cell: median over paired seeds of (baseline steps / arm steps) to reach the baseline's metric at "
             "25%, 50% and 100% of its run, and the 90% bootstrap interval over seeds. **↑**: the interval lies "
             "entirely above 1 (faster); ↓: entirely below 1. 'cens.': seeds that never reached the target within "
             "the run (ranked below every reached seed, never counted as their bound); a median or interval end on "
             "censored seeds is 'cens.'. Seconds: the 100% median × the baseline's step time / the arm's, the arms' "
             "step times measured side by side after the grid (interleaved rounds, one thread).", ""]
    for domain, batches in results.items():
        dm = meta.get("domains", {}).get(domain, {})
        lines += [f"## {domain}: {dm.get('metric', '')}", "",
                  f"seeds {dm.get('seeds')}, {dm.get('evals')} evaluations per run on {dm.get('eval_n')} samples; "
                  f"combination: {dm.get('combination', '—')}", ""]
        for batch, arms in batches.items():
            steps = dm.get("batches", {}).get(batch) or dm.get("batches", {}).get(int(batch))
            lines += [f"### batch {batch} ({steps} steps)", "",
                      "| arm | recipe (source) | to 25% | to 50% | to 100% | seconds × | vs its control (100%) | "
                      "ms/step | metric at the end (median) | adaptive: updates, TV(p, uniform) |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for name, r in arms.items():
                t = r["targets"]
                ends = sorted(x["value_at_end"] for x in r["per_seed"] if x["value_at_end"] == x["value_at_end"])
                end = f"{ends[len(ends) // 2]:.3g}" if ends else "—"
                vc = t["1.0"].get("vs_control")
                vcs = "—" if not vc else _ratio({"ratio_median": vc["median"], "ratio_ci90": vc["ci"],
                                                  "censored": vc["censored"]}) + f" vs {r['control']}"
                ad = "—" if "policy_updates" not in r else f"{r['policy_updates']}, {r['p_tv_final']:.3f}"
                sec = r.get("seconds_ratio_median")
                ms = "—" if r.get("ms_per_step") is None else f"{r['ms_per_step']:.1f}"
                lines.append(f"| {name} | {r['recipe']} ({r['source']}) | {_ratio(t['0.25'])} | {_ratio(t['0.5'])} | "
                             f"{_ratio(t['1.0'])} | {'—' if sec is None else f'{sec:.2f}'} | {vcs} | "
                             f"{ms} | {end} | {ad} |")
            lines.append("")
    (out / "convergence.md").write_text("\n".join(lines) + "\n")
    for domain in results:
        plot(results[domain], domain, meta.get("domains", {}).get(domain, {}).get("metric", ""),
             out / f"convergence-{domain}.png")


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
        ax[0, j].legend(fontsize=7, ncol=2)
        others = [a for a in arms if a != "baseline"]
        x = np.arange(len(others))
        for k, (frac, off) in enumerate((("0.25", -0.27), ("0.5", 0.0), ("1.0", 0.27))):
            med = [arms[a]["targets"][frac]["ratio_median"] for a in others]
            lo = [arms[a]["targets"][frac]["ratio_ci90"][0] for a in others]
            hi = [arms[a]["targets"][frac]["ratio_ci90"][1] for a in others]
            m = np.array([v if v is not None else np.nan for v in med])
            lo_ = np.array([v if v is not None else 0.0 for v in lo])  # a censored lower end: drawn down to 0
            hi_ = np.array([v if v is not None else np.nan for v in hi])
            ax[1, j].bar(x + off, np.nan_to_num(m), width=0.26, color=f"C{k}", label=f"to the baseline at {frac}")
            ax[1, j].errorbar(x + off, np.nan_to_num(m), yerr=[np.clip(np.nan_to_num(m) - lo_, 0, None),
                                                               np.clip(np.nan_to_num(hi_ - m), 0, None)],
                              fmt="none", ecolor="k", capsize=2, lw=0.8)
        ax[1, j].axhline(1, color="grey", ls=":")
        ax[1, j].set_xticks(x, others, rotation=35, ha="right", fontsize=8)
        ax[1, j].set(ylabel="steps ratio: baseline / arm (90% interval)", title=f"{domain}, batch {batch}: speed-up")
        ax[1, j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
