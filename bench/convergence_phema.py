"""The post-hoc EMA arms of the convergence study (bench/convergence.py): runs that wrote power-function EMA
snapshots (phema.every, fasttrain/optim/phema.py) evaluated again with the EMA of a chosen length σ_rel,
reconstructed from their snapshots at each of the run's evaluation steps (fasttrain/optim/posthoc.py).

  choose     σ_rel from SIGMAS on the main seeds: the one with the lowest median metric at the end of the run
             (every σ_rel reconstructed at the last step of each main-seed run), as EDM2 §3 chooses it by FID
  curve      a run's curve with σ_rel: the run's own evaluation at step 0 (the initial network, which every
             average equals), then the reconstruction at every later evaluation step, evaluated with the run's
             own settings (samples, sampling steps, seed, extractors), so that it pairs with the fixed EMA's
             curve of the same run
Both are kept beside the run (phema-sweep.json, phema-curve-<σ>.json) and reused by --resume.
"""
from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

SIGMAS = (0.03, 0.05, 0.08, 0.12, 0.17, 0.23)


def _evaluate(run: Path, step: int, sigmas, eval_n: int) -> dict:
    """{σ: {metric: value}} of the reconstructions at `step`, with the run's evaluation settings."""
    from fasttrain.bundle import ModelBundle
    from fasttrain.generation.evaluate import EvalSettings, reference_for, run_evaluation
    from fasttrain.optim.posthoc import reconstruct, write

    out = {}
    states = reconstruct(run, sigmas, step)
    with tempfile.TemporaryDirectory() as d:
        for s, path in zip(sigmas, write(states, d)):
            b = ModelBundle.load(path, device="cpu")
            base = EvalSettings.from_config(b.cfg)
            settings = EvalSettings(num_samples=eval_n, steps=base.steps, solver=base.solver, extractor=base.extractor,
                                    bpd=False, seed=base.seed, extra_extractors=base.extra_extractors)
            out[float(s)] = run_evaluation(b, settings, reference_for(b.cfg, b.spec))
    return out


def _eval_rows(run: Path) -> list[dict]:
    from fasttrain.logger import read_jsonl

    return [r for r in read_jsonl(run / "metrics.jsonl") if any(k.startswith("eval/") for k in r)]


def sweep(run: Path, eval_n: int, sigmas=SIGMAS) -> dict:
    """{σ: metrics} at the run's last step (cached in RUN/phema-sweep.json)."""
    path = run / "phema-sweep.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("sigmas") == list(sigmas) and saved.get("eval_n") == eval_n:
            return {float(k): v for k, v in saved["values"].items()}
    step = max(r["step"] for r in _eval_rows(run))
    values = _evaluate(run, step, list(sigmas), eval_n)
    path.write_text(json.dumps({"sigmas": list(sigmas), "eval_n": eval_n, "step": step,
                                "values": {str(k): v for k, v in values.items()}}))
    return values


def choose(runs: list[Path], metric: str, eval_n: int, sigmas=SIGMAS) -> dict:
    """σ_rel with the lowest median `metric` at the end over `runs` (the main seeds), with every σ's median."""
    per = {s: [] for s in sigmas}
    for run in runs:
        for s, m in sweep(run, eval_n, sigmas).items():
            if m.get(metric) is not None:
                per[s].append(m[metric])
    medians = {s: statistics.median(v) for s, v in per.items() if v}
    return {"sigmas": list(sigmas), "median_at_end": {str(s): v for s, v in medians.items()},
            "chosen": min(medians, key=medians.get) if medians else None, "runs": len(runs), "metric": metric}


def curve_file(run: Path, sigma: float) -> Path:
    return run / f"phema-curve-{sigma:.4f}.json"


def make_curve(run: Path, sigma: float, eval_n: int) -> None:
    """The run's curve with σ_rel (module docstring), all of its eval/* metrics, in RUN/phema-curve-<σ>.json."""
    path = curve_file(run, sigma)
    if path.is_file() and json.loads(path.read_text()).get("eval_n") == eval_n:
        return
    rows = sorted(_eval_rows(run), key=lambda r: r["step"])
    sweep_path = run / "phema-sweep.json"
    known = {}
    if sweep_path.is_file():  # the last step's reconstruction of this σ, if the sweep made it
        saved = json.loads(sweep_path.read_text())
        if saved.get("eval_n") == eval_n and str(float(sigma)) in saved["values"]:
            known[saved["step"]] = saved["values"][str(float(sigma))]
    points = []
    for r in rows:
        if r["step"] == 0:
            points.append({"step": 0, **{k[5:]: v for k, v in r.items() if k.startswith("eval/")}})
            continue
        m = known.get(r["step"]) or _evaluate(run, r["step"], [sigma], eval_n)[float(sigma)]
        points.append({"step": r["step"], **m})
    path.write_text(json.dumps({"sigma_rel": sigma, "eval_n": eval_n, "points": points}))


def curve(run: Path, sigma: float, metric: str) -> dict | None:
    """The curve of a finished run with σ_rel in convergence_runs.curve's layout (None: not made)."""
    path = curve_file(run, sigma)
    if not path.is_file():
        return None
    pts = [p for p in json.loads(path.read_text())["points"] if p.get(metric) is not None]
    return {"steps": [p["step"] for p in pts], "value": [p[metric] for p in pts],
            "agreement": [p.get("digits_label_agreement") for p in pts]}
