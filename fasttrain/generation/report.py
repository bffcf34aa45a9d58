"""`fasttrain report RUN_DIR`: one self-contained HTML page per run (images inlined as base64): the
loss curve, FID/KID/bits-per-dim over training, the per-timestep curves, a sample grid (for a latent
run also decoded by its VAE; for a text run with its prompts, one per column), the final metrics and
the config."""
from __future__ import annotations

import base64
import html
import json
import sys
from pathlib import Path

from jinja2 import Template

from .. import checkpoint as ckpt
from .. import plots
from ..errors import MissingFile, UserError
from ..logger import number, read_jsonl

PAGE = Template("""<!doctype html>
<html><head><meta charset="utf-8"><title>fasttrain · {{ name }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1250px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
img { max-width: 100%; } table { border-collapse: collapse; } td, th { padding: 2px 12px; text-align: left; }
tr:nth-child(even) { background: #f6f6f6; } pre { background: #f6f6f6; padding: 1em; font-size: 0.85em; }
</style></head><body>
<h1>{{ name }}</h1>
<p>{{ summary }}</p>
{% for title, img in figures %}<h2>{{ title }}</h2><img src="data:image/png;base64,{{ img }}">
{% if prompts and title.startswith("Samples") %}<p>One column per prompt, left to right:</p><ol>
{% for p in prompts %}<li>{{ p if p else "(the empty prompt)" }}</li>{% endfor %}</ol>{% endif %}
{% endfor %}
{% if metrics %}<h2>Final evaluation</h2><table>
{% for k, v in metrics %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}
</table>{% endif %}
<h2>Config</h2><pre>{{ config }}</pre>
</body></html>
""", autoescape=True)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))


def objective_from_checkpoint(run: Path):
    """The training objective's statistics and sampler as the checkpoint left them (every rank's
    pending window merged in), to redraw the per-timestep figure of a run that has none; no model,
    data or process group. (The report's samples and evaluation never need this.)"""
    from omegaconf import OmegaConf

    from ..bundle import build_objective
    from ..config import Config

    plain = ckpt.read_plain(run)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), plain["config"])
    obj = build_objective(cfg)
    obj.load_state_dict(plain["objective"])
    obj.load_rank_states([r["objective"] for r in plain["ranks"]], 0, 1 + len(plain["ranks"]))  # merged into rank 0
    obj.sync_stats()
    interference = None
    if plain.get("interference"):
        from ..diffusion.interference import InterferenceDiagnostic

        interference = InterferenceDiagnostic(obj.T)
        interference.load_state_dict(plain["interference"])
    return obj, interference


def decoded_samples(run: Path, vae: str | None = None) -> Path | None:
    """A latent run's samples (RUN/samples.pt) decoded by its VAE (the recorded one, or `vae`) into
    RUN/samples-decoded.png, unless training wrote it already; None for runs with nothing to decode."""
    out = run / "samples-decoded.png"
    if (out.is_file() and vae is None) or not (run / "samples.pt").is_file() or ckpt.latest(run) is None:
        return out if out.is_file() else None
    spec = ckpt.read_plain(run).get("data_spec", {})
    if not spec.get("latents"):
        return None
    import torch

    from ..bundle import DataSpec
    from ..pretrained.vae import LatentCodec

    x = torch.load(run / "samples.pt", map_location="cpu", weights_only=True)
    images = LatentCodec.load(spec["latents"], vae).decode(x)
    d = DataSpec("decoded", images.shape[1], images.shape[-1], spec["num_classes"], spec["label_dropout"])
    return plots.save_samples(out, images, d)


def write_report(run_dir: str | Path, vae: str | None = None) -> Path:
    """RUN/report.html; a latent run's samples decoded by its VAE (or the folder `vae`)."""
    run = Path(run_dir)
    metrics_file = run / "metrics.jsonl"
    if not metrics_file.is_file():
        raise MissingFile(f"{run} is not a fasttrain run directory (no metrics.jsonl)")
    skipped: list = []
    rows = read_jsonl(metrics_file, skipped)
    objective, interference = None, None
    if not (run / "timesteps.png").is_file() and ckpt.latest(run) is not None:
        objective, interference = objective_from_checkpoint(run)
    plots.plot_run(run, objective, interference=interference)
    try:
        decoded_samples(run, vae)
    except UserError as e:  # the recorded VAE is gone: the report goes on without them (--vae names another)
        if vae is not None:
            raise
        print(f"fasttrain: the report has no decoded samples ({e})", file=sys.stderr)
    figures = [(title, _b64(run / f)) for title, f in (
        ("Training loss", "loss.png"), ("Evaluation over training", "eval.png"),
        ("Per-timestep statistics", "timesteps.png"), ("Learned timestep distribution", "adaptive.png"),
        ("Cross-timestep interference", "interference.png"), ("Samples (EMA)", "samples.png"),
        ("Samples (EMA), decoded by the VAE", "samples-decoded.png"))
        if (run / f).is_file()]
    last_eval = {}
    for r in rows:
        last_eval.update({k[5:]: v for k, v in r.items() if str(k).startswith("eval/") and v is not None})
    steps = int(max((number(r, "step") or 0 for r in rows), default=0))
    images = int(max((number(r, "images") or 0 for r in rows), default=0))
    summary = f"{steps} steps, {images} training images; {len(figures)} figures"
    if skipped:
        n, why = skipped[0]
        note = (f"skipped {len(skipped)} unreadable line(s) of metrics.jsonl (line {n}: {why}"
                f"{', ...' if len(skipped) > 1 else ''})")
        summary += "; " + note
        print(f"fasttrain: report: {note}", file=sys.stderr)
    config = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else "(no config.yaml)"
    prompts = []  # a text run's sample grid: one column per prompt (train.py)
    if (run / "sample-prompts.json").is_file():
        try:
            prompts = [str(p) for p in json.loads((run / "sample-prompts.json").read_text())["columns"]]
        except (ValueError, KeyError, TypeError):
            print("fasttrain: report: sample-prompts.json is unreadable; the grid's prompts are not shown",
                  file=sys.stderr)
    out = run / "report.html"
    out.write_text(PAGE.render(name=run.name, summary=summary, figures=figures,
                               metrics=[(k, _fmt(v)) for k, v in last_eval.items()], config=config,
                               prompts=prompts))
    return out

