"""`fasttrain ema RUN --sigma-rel S [S ...]`: post-hoc EMA reconstructions of a run's snapshots
(optim/posthoc.py) written as checkpoint files that `sample`, `eval` and `export` read; and
`fasttrain eval --ckpt RUN --sigma-rel S [S ...]`: each reconstructed and evaluated, FID against σ_rel
in RUN/ema/sweep-<step>.{json,png}. cli/commands.py parses the flags."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

from ..errors import InvalidInput


def _run_dir(path: str) -> Path:
    p = Path(path)
    if p.is_file():  # RUN/last.pt
        p = p.parent
    if not p.is_dir():
        raise InvalidInput(f"{path} is not a run directory")
    return p


def _write(run: Path, sigma_rels, step, out) -> list[Path]:
    from ..optim.posthoc import reconstruct, write
    from ..paths import check_output

    folder = Path(out) if out else run / "ema"
    check_output(str(folder), "--out", {"the run's snapshots": str(run / "phema")})
    states = reconstruct(run, sigma_rels, step, progress=sys.stderr.isatty())
    return write(states, folder)


def ema(args) -> int:
    sig = list(dict.fromkeys(args.sigma_rel))
    paths = _write(_run_dir(args.run), sig, args.step, args.out)
    for s, p in zip(sig, paths):
        print(f"wrote {p} (σ_rel {s:g}); sample, eval or export it: fasttrain eval --ckpt {p}")
    return 0


def sweep(args) -> int:
    """Every --sigma-rel reconstructed (rank 0) and evaluated with the eval command's settings (all ranks)."""
    from ..parallel.distributed import all_gather_objects, init
    from .generate import evaluate

    info = init()
    args.sigma_rel = list(dict.fromkeys(args.sigma_rel))
    run = _run_dir(args.ckpt)
    folder = Path(args.out).parent if args.out else run / "ema"
    if info.is_main:
        paths = _write(run, args.sigma_rel, args.step, str(folder))
    paths = all_gather_objects([str(p) for p in paths] if info.is_main else None)[0]
    rows, code = [], 0
    for s, p in zip(args.sigma_rel, paths):
        sub = copy.copy(args)
        sub.ckpt, sub.out, sub.sigma_rel, sub.samples = p, str(Path(p).with_suffix(".eval.json")), None, None
        code = evaluate(sub) or code
        if info.is_main and Path(sub.out).is_file():
            rows.append({"sigma_rel": float(s), "checkpoint": p, **json.loads(Path(sub.out).read_text())})
    if not info.is_main or not rows:
        return code
    step = rows[0].get("step")
    scored = [r for r in rows if r.get("fid") is not None]
    best = min(scored, key=lambda r: r["fid"])["sigma_rel"] if scored else None
    out = Path(args.out) if args.out else folder / f"sweep-{step:09d}.json"
    out.write_text(json.dumps({"run": str(run), "step": step, "best_sigma_rel": best, "results": rows}, indent=2))
    png = plot_sweep(rows, out.with_suffix(".png"), f"{run.name} · step {step}")
    print("σ_rel sweep: " + ", ".join(f"{r['sigma_rel']:g} → FID {r['fid']:.3g}" for r in scored)
          + (f"; best {best:g}" if best is not None else "") + f"; wrote {out} and {png}")
    return code


def plot_sweep(rows: list[dict], path: Path, title: str) -> Path:
    """FID (and the other FIDs an evaluation recorded, eval/fid_<extractor>) against σ_rel."""
    from ..plots.common import finish, plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    keys = ["fid"] + sorted({k for r in rows for k in r if k.startswith("fid_")})
    for k in keys:
        pts = sorted((r["sigma_rel"], r[k]) for r in rows if r.get(k) is not None)
        if pts:
            ax.plot(*zip(*pts), "o-", label=k)
    ax.set_xlabel("σ_rel (post-hoc EMA length)")
    ax.set_ylabel("FID")
    ax.legend()
    ax.grid(alpha=0.3)
    return finish(fig, path, title)
