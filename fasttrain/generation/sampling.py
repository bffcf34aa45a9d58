"""Generating from a model bundle (bundle.py): the denoiser the solvers step with (classifier-free
guidance, clipping to the data range) and samples in chunks of bounded memory, each chunk or image seeded
so that the results depend neither on n nor on the device. `ModelBundle.generate` and `solver_fn` call
these; the bundle is read, never changed (its network is put in eval mode with the EMA weights swapped in
for the call, `ModelBundle.averaged`)."""
from __future__ import annotations

import torch

from .. import seeds
from ..conditioning import using
from ..diffusion.solvers import generate as run_solver
from ..errors import CheckpointError, InvalidInput


def solver_fn(b, labels: torch.Tensor | None = None, guidance: float = 1.0, clip: float | None = None,
              uncond_offset: int = 0):
    """`denoise(x_t, t) -> (x̂0, ε̂)` for the solvers: classifier-free guidance (Ho & Salimans 2022, Eq. 6,
    on x̂0) and clipping of x̂0 to the data range (ε̂ kept consistent with it). The unconditional side is
    the null label (class runs) or, for text runs, the prompt table's last row: label + `uncond_offset`
    (the table's row count; conditioning.py codes a row of the table as rows + row)."""
    if guidance != guidance or guidance in (float("inf"), float("-inf")):
        raise InvalidInput(f"guidance must be a finite number, got {guidance}")
    null = b.spec.num_classes if b.spec.text is None else None
    alpha, sigma = b.schedule.alpha.float(), b.schedule.sigma.float()

    def denoise(x_t, t: int):
        tt = torch.full((x_t.shape[0],), t, device=x_t.device, dtype=torch.long)
        if labels is None or guidance == 1.0:
            x0 = b.x0_hat(x_t, tt, labels)
        else:
            uncond = torch.full_like(labels, null) if null is not None else labels + uncond_offset
            both = b.x0_hat(torch.cat([x_t, x_t]), torch.cat([tt, tt]), torch.cat([labels, uncond]))
            cond, uncond = both.chunk(2)
            x0 = uncond + guidance * (cond - uncond)
        a, s = alpha[t].to(x_t.device), sigma[t].to(x_t.device)
        if clip is not None:
            x0 = x0.clamp(-clip, clip)
        return x0, (x_t - a * x0) / s

    return denoise


@torch.no_grad()
def generate(b, n: int, labels: torch.Tensor | None = None, *, seed: int = 0, steps: int = 50, solver: str = "ddim",
             guidance: float = 1.0, ema: bool = True, progress: bool = False, eta: float | None = None,
             chunk: int = 1024, spacing: str | None = None, first_image: int | None = None,
             prompts: list[str] | None = None, negative_prompt: str = "") -> torch.Tensor:
    """n samples of bundle `b` (ModelBundle.generate's contract): text runs condition on the prompt table of
    `prompts` (default the data's) with `negative_prompt` as its last row."""
    if b.spec.text is None:
        return _generate(b, n, labels, seed, steps, solver, guidance, ema, progress, eta, chunk, spacing,
                         first_image)
    table = b.prompts.table(list(prompts or b.spec.text.get("prompts") or []), negative_prompt)
    if labels is None:
        labels = (torch.arange(n, device=b.device) + (first_image or 0)) % (table.rows - 1)
    with using(b.net, table):
        return _generate(b, n, labels, seed, steps, solver, guidance, ema, progress, eta, chunk, spacing,
                         first_image, table.rows)


def _generate(b, n, labels, seed, steps, solver, guidance, ema, progress, eta, chunk, spacing, first_image,
              uncond_offset: int = 0):
    if n < 1:
        raise InvalidInput(f"the number of samples must be >= 1, got {n}")
    if steps < 1:
        raise InvalidInput(f"sampling steps must be >= 1, got {steps}")
    b.net.check_sampling()
    opts = {} if eta is None else {"eta": float(eta)}
    clip = 1.0 if b.spec.is_images else None
    outs = []
    with b.averaged(ema):
        for i, lo in enumerate(range(0, n, chunk)):
            m = min(chunk, n - lo)
            lab = None if labels is None else labels[lo:lo + m].to(b.device)
            if first_image is None:
                g = torch.Generator().manual_seed(seed if i == 0 else seeds.derive(seed, "eval", i))
            else:
                g = [torch.Generator().manual_seed(seed + first_image + lo + k) for k in range(m)]
            outs.append(run_solver(solver_fn(b, lab, guidance, clip, uncond_offset), b.schedule, (m,) + b.spec.shape,
                                   solver=solver, steps=min(steps, b.schedule.T), generator=g, device=b.device,
                                   progress=progress, spacing_kind=spacing or b.cfg.sample.spacing, **opts))
    x = torch.cat(outs)
    if not bool(torch.isfinite(x).all()):
        raise CheckpointError(f"the samples are not finite: the weights of step {b.step} are broken "
                              f"(resume from an earlier checkpoint)")
    return x
