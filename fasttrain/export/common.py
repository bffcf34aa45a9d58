"""What every exporter shares (dispatch.py, stable_diffusion.py, sd3.py): the export folder written whole
(nothing half-written is left when a write fails) and the run's diffusers scheduler."""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
from pathlib import Path

import torch

from .. import optional
from ..errors import InvalidInput, UserError, WriteError
from ..paths import writable_folder
from ..pretrained.scheduler_config import to_diffusers


def check_folder(out) -> Path:
    """An export folder that can be written: absent or empty, not a file, not read-only (one line)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file, not a folder" if not out.is_dir() else "already exists and is not empty"
        raise InvalidInput(f"export folder {out} {what} (nothing was written)")
    writable_folder(out, "export folder")
    return out


@contextlib.contextmanager
def written_whole(out: Path):
    """The export folder `out` (absent or empty), written whole: the exporter writes into the folder this
    yields, a hidden sibling `.NAME.PID.tmp`, which is renamed to `out` only once everything is in it (a
    rename onto an absent or empty folder is atomic on POSIX). If anything fails meanwhile (a full disk,
    a killed process's next run aside) the sibling is removed and `out` stays as it was; a write that
    fails for the disk's or the folder's reasons (OSError) is one line naming `out` (WriteError). Every
    exporter writes through this (dispatch.py, stable_diffusion.py, sd3.py; tests/reliability/)."""
    out = check_folder(out)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # this process's own leftover, if any
        tmp.mkdir(parents=True)
        yield tmp
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, UserError):
            why = e.strerror or str(e) or type(e).__name__
            raise WriteError(f"export to {out} failed: {why} (nothing was written: the partial folder was "
                             f"removed)") from None
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


@torch.no_grad()
def transformer_probe(b, backbone, transformer, name: str):
    """What the text-transformer exports check their stock transformer on, in float64 (sd3.py, flux.py):
    (the stock copy, x [3, C, H, W], t at the first, middle and last step, the backbone's output, the
    prompt rows {states, pooled} of "a" / "" / "a"), and `close(out)`: max |Δ|, raised on as an export
    bug above 1e-6 of the output's scale."""
    from ..conditioning import using

    net = copy.deepcopy(backbone).double().eval()
    hf = copy.deepcopy(transformer).double().eval()
    table = b.prompts.table(["a", ""], "").to("cpu")
    g = torch.Generator().manual_seed(0)
    T = b.schedule.T
    x = torch.randn((3,) + tuple(b.spec.shape), generator=g, dtype=torch.float64)
    t = torch.tensor([0, T // 2, T - 1])
    y = torch.tensor([0, 1, 0])
    with using(net, table):
        a = net(x, t, y)
        rows = table.gather(y, 3, torch.float64)

    def close(out) -> float:  # the stock output's first channels (SD3's may carry more than the backbone's)
        err = float((a - out[:, :a.shape[1]]).abs().max())
        if not err <= 1e-6 * max(1.0, float(a.abs().max())):
            raise RuntimeError(f"the {name} transformer differs from fasttrain's backbone by {err:.3g} (an export bug)")
        return err

    return net, hf, x, t, rows, close


def stock_transformer(run: str, b, ema: bool, refusal, verify):
    """(the run's transformer as a float32 copy, max |Δ| to the backbone) for a stock text-transformer
    pipeline (sd3.py, flux.py): refused in one line where `refusal(b)` says why, the raw or EMA weights,
    a LoRA run's adapter folded into the base, checked by `verify(b, backbone, transformer)`."""
    from ..pretrained import lora

    why = refusal(b)
    if why:
        raise InvalidInput(f"{run} cannot be exported to diffusers: {why}")
    with b.averaged(ema) as net:
        transformer = copy.deepcopy(net.net.model).float().eval()
        if lora.identity(b.net):  # a LoRA run's full pipeline: the adapter folded into the base weights
            transformer = lora.merged(transformer)
        return transformer, verify(b, net.net, transformer)
