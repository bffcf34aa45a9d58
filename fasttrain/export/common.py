"""What every exporter shares (dispatch.py, stable_diffusion.py, sd3.py): the export folder written whole
(nothing half-written is left when a write fails) and the run's diffusers scheduler."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from .. import optional
from ..pretrained.scheduler_config import to_diffusers


@contextlib.contextmanager
def written_whole(out: Path):
    """The export folder `out`, created; if anything fails while it is written, it is removed again, so
    that no half-written export is left (every exporter writes through this)."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield out
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def scheduler_for(bundle):
    """The run's scheduler (scheduler_config.to_diffusers) and a note when it samples otherwise."""
    diffusers = optional.diffusers("export --to diffusers")
    cfg = bundle.cfg
    df, spacing = cfg.diffusion, cfg.sample.spacing
    name, config = to_diffusers(df.schedule, df.T, df.zero_terminal_snr, df.prediction, bundle.spec.is_images,
                                spacing, df.flow_shift)
    note = None
    if df.schedule != "flow" and config["timestep_spacing"] != spacing:
        note = (f"the run samples with sample.spacing={spacing}, on which diffusers' DDIMScheduler cannot step "
                f"(it steps to t - T//n): the scheduler has {config['timestep_spacing']} spacing, the pipeline equals "
                f"`fasttrain sample --spacing {config['timestep_spacing']}`")
    return getattr(diffusers, name).from_config(config), note
