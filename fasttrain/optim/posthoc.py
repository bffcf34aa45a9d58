"""Post-hoc EMA reconstruction (EDM2 §3, App. C.3; NVlabs/edm2 reconstruct_phema.py does the same for its
pickles): the EMA of relative length σ_rel at a snapshot's time, as the least-squares combination of every
earlier snapshot's profiles (optim/phema.py `coefficients`), written as a checkpoint file that `sample`,
`eval`, `report` and `export` read as they read any run's (bundle.py).

    states = reconstruct("runs/x", [0.05, 0.1, 0.2])             # the last snapshot's time
    paths = write(states, "runs/x/ema")                          # runs/x/ema/phema-000005000-0.1000.pt

A reconstruction's file holds the run's checkpoint (config, data spec, the non-averaged state: buffers, a
mixed head's choice, a LoRA run's identity) with the reconstructed weights as both the network's and the
EMA's, the step and images of the snapshot time, and "phema" (σ_rel, the snapshots used, the coefficients'
range); no optimizer: it is a model to generate with, not a run to resume. The weights are accumulated in
float64 and stored in float32.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import snapshots as snap
from ..errors import CheckpointError, InvalidInput
from .phema import check_sigma_rel, coefficients


def _network(meta: dict):
    """The (unsharded) network a snapshot's profiles belong to, built from its config alone."""
    from omegaconf import OmegaConf

    from ..bundle import build_network
    from ..config import Config
    from ..data.spec import DataSpec
    from ..models import weights_from_checkpoint

    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), meta["config"])
        spec = DataSpec(**meta["data_spec"])
    except Exception as e:  # a snapshot of another version or hand-edited
        raise CheckpointError(f"a snapshot's config does not fit this version ({type(e).__name__})") from None
    with weights_from_checkpoint():
        return build_network(cfg, spec)


def reconstruct(run, sigma_rels, step: int | None = None, progress: bool = False) -> list[dict]:
    """One checkpoint state per σ_rel (module docstring), at snapshot `step` (default: the last one) from the
    snapshots at steps ≤ it; `run` is a run directory (its RUN/phema/ and its checkpoint)."""
    from ..checkpoint import read_bundle_state
    from .ema import clean_name, trained

    out_sig = [check_sigma_rel(s, "--sigma-rel") for s in sigma_rels]
    if not out_sig:
        raise InvalidInput("--sigma-rel: give at least one σ_rel to reconstruct")
    found = snap.find(run)
    if not found:
        raise CheckpointError(f"no post-hoc EMA snapshots in {Path(run) / snap.FOLDER} (train with phema.every=N)")
    if step is None:
        step = found[-1].step
    elif not any(s.step == step for s in found):
        at = ", ".join(str(s.step) for s in found)
        raise InvalidInput(f"--step {step}: no snapshot at that step (snapshots at {at})")
    used = [s for s in found if 0 < s.step <= step]
    metas = [snap.read_meta(s) for s in used]
    net = _network(metas[-1])
    like = {clean_name(n): p.detach() for n, p in trained(net)}
    sig = [float(x) for x in metas[-1]["sigma_rels"]]
    for m, s in zip(metas, used):
        if [float(x) for x in m["sigma_rels"]] != sig:
            raise CheckpointError(f"{s.path}: its profiles {m['sigma_rels']} are not the run's {sig}")
    times = [float(m["images"]) for m in metas for _ in sig]
    profile_sig = [x for _ in metas for x in sig]
    out_time = float(metas[-1]["images"])
    c = coefficients(times, profile_sig, out_time, out_sig)  # [snapshots × profiles, outputs]
    acc = [{n: torch.zeros(t.shape, dtype=torch.float64) for n, t in like.items()} for _ in out_sig]
    iterator = used
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(used, desc="phema", unit="snapshot")
    for i, s in enumerate(iterator):
        shadows = snap.read_shadows(s, like, len(sig))
        for k in range(len(sig)):
            row = c[i * len(sig) + k]
            for name, t in shadows[f"p{k}"].items():
                t64 = t.double()
                for j, a in enumerate(acc):
                    a[name].add_(t64, alpha=float(row[j]))
    base, model_sd, _ = read_bundle_state(run, lambda st: _network(st))
    states = []
    for j, s_out in enumerate(out_sig):
        weights = {n: v.float() for n, v in acc[j].items()}
        model = dict(model_sd)
        for n, v in weights.items():
            if n in model:
                model[n] = v.to(model[n].dtype)
        plain = {k: v for k, v in base.items() if k not in ("optimizer", "model", "ema", "ranks", "averages")}
        plain["train"] = {**base.get("train", {}), "step": int(step), "images": int(out_time)}
        states.append({**plain, "model": model, "ema": {"n": int(step), "shadow": weights},
                       "phema": {"sigma_rel": s_out, "step": int(step), "images": out_time, "tracked": sig,
                                 "snapshots": [x.step for x in used], "coefficients_min": float(c[:, j].min()),
                                 "coefficients_max": float(c[:, j].max()), "source": str(Path(run))}})
    return states


def file_name(step: int, sigma_rel: float) -> str:
    """EDM2's naming (reconstruct_phema.py: phema-<kimg>-<std>.pkl), by step."""
    return f"phema-{step:09d}-{sigma_rel:.4f}.pt"


def write(states: list[dict], out_dir) -> list[Path]:
    """Each state as OUT/phema-<step>-<σ_rel>.pt (atomic, checkpoint/formats.py)."""
    from ..checkpoint import save_file

    out = Path(out_dir)
    return [save_file(out / file_name(st["phema"]["step"], st["phema"]["sigma_rel"]), st) for st in states]
