"""Evaluation: FID, KID and precision/recall through torch-fidelity, and the negative ELBO in bits/dim.

Feature extractors: "fasttrain-digits" (the project's own digits classifier, offline: features.py) for
the built-in digits, and torch-fidelity's Inception ("inception-v3-compat") for real image data, with
`weights_path` for machines that cannot download its weights.

Negative ELBO (Ho et al. 2020, Eq. 5; Kingma et al. 2021, VDM Eq. 13 for the per-step form): with the
reverse variance set to the posterior variance, each step's KL is
    L_i = ½·(SNR_{i-1} - SNR_i)·‖x0 - x̂0(x_i, i)‖²      (i = 1..T-1)
plus the prior term KL(q(x_{T-1}|x0) ‖ N(0, I)) and the decoder -log p(x0 | x_0) with mean x̂0 and
variance 1/SNR_0: discretized to 256 levels on [-1, 1] for images (Ho et al. 2020, Eq. 13), a plain
Gaussian density for continuous (2-D toy) data. The sum over i is estimated from `n_t` stratified
timesteps per sample (all of them when n_t is None).
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset

from .diffusion import prediction as P
from .diffusion.schedule import NoiseSchedule

EXTRACTORS = ("auto", "fasttrain-digits", "inception-v3-compat", "none")


class UInt8Images(Dataset):
    """torch-fidelity's input format: uint8 [3, H, W] per item, from float images in [-1, 1]."""

    def __init__(self, x: torch.Tensor):
        x = ((x.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        self.x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


def fidelity(samples: torch.Tensor, reference: torch.Tensor, extractor: str = "fasttrain-digits",
             weights_path: str | None = None, prc: bool = True) -> dict:
    """FID, KID (mean ± std) and precision/recall of `samples` against `reference` (images in [-1, 1])."""
    import torch_fidelity

    if extractor == "fasttrain-digits":
        from .features import _register

        _register()
    kwargs = dict(input1=UInt8Images(samples), input2=UInt8Images(reference), cuda=torch.cuda.is_available(),
                  fid=True, kid=True, prc=prc, feature_extractor=extractor, verbose=False, cache=False,
                  save_cpu_ram=True, kid_subset_size=min(len(samples), len(reference), 1000), batch_size=256)
    if weights_path:
        kwargs["feature_extractor_weights_path"] = weights_path
    m = torch_fidelity.calculate_metrics(**kwargs)
    out = {"fid": m["frechet_inception_distance"], "kid": m["kernel_inception_distance_mean"],
           "kid_std": m["kernel_inception_distance_std"]}
    if prc:
        out["precision"], out["recall"] = m["precision"], m["recall"]
    return out


def _log_discretized_gaussian(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """log P(x) of 8-bit data in [-1, 1] under a Gaussian integrated over each bin of width 2/255,
    the edge bins extending to ±inf (Ho et al. 2020, Eq. 13)."""
    inv = torch.exp(-log_scale)
    upper = torch.special.ndtr(inv * (x - mean + 1 / 255))
    lower = torch.special.ndtr(inv * (x - mean - 1 / 255))
    p = torch.where(x < -0.999, upper, torch.where(x > 0.999, 1 - lower, upper - lower))
    return torch.log(p.clamp_min(1e-12))


@torch.no_grad()
def nelbo_bits_per_dim(model, schedule: NoiseSchedule, prediction: str, x0: torch.Tensor, *, labels=None,
                       n_t: int | None = None, discrete: bool = True, generator: torch.Generator | None = None,
                       batch_size: int = 512) -> dict:
    """Per-dimension negative ELBO of x0 in bits (mean over samples) and its three parts."""
    T, dev = schedule.T, x0.device
    sch = schedule.to(dev)
    alpha, sigma, snr = sch.alpha, sch.sigma, sch.snr
    snr_prev = torch.cat([snr[:1], snr[:-1]])  # SNR_{i-1}; unused at i = 0
    D = x0[0].numel()
    parts = {"prior": [], "diffusion": [], "decoder": []}
    for lo in range(0, len(x0), batch_size):
        xb = x0[lo:lo + batch_size].double()
        yb = None if labels is None else labels[lo:lo + batch_size]
        B = len(xb)
        flat = xb.flatten(1)

        def x0_hat(t):
            a, s = alpha[t].view(-1, *[1] * (xb.ndim - 1)), sigma[t].view(-1, *[1] * (xb.ndim - 1))
            eps = torch.randn(xb.shape, generator=generator, device=dev, dtype=torch.float64)
            xt = a * xb + s * eps
            out = model(xt.float(), t) if yb is None else model(xt.float(), t, yb)
            return P.to_x0_eps(prediction, out.double(), xt, a, s)[0]

        # prior: KL(N(a x0, s²) ‖ N(0, 1)) per dimension, summed
        a_T, s_T = alpha[-1], sigma[-1]
        parts["prior"].append(0.5 * (s_T**2 + a_T**2 * flat**2 - 1 - torch.log(s_T**2)).sum(1))
        # diffusion: (T-1)·E_i[L_i], i drawn stratified over 1..T-1 (or all of them)
        steps = T - 1
        k = steps if n_t is None else min(n_t, steps)
        total = torch.zeros(B, dtype=torch.float64, device=dev)
        for j in range(k):
            if n_t is None:
                i = torch.full((B,), j + 1, device=dev)
            else:
                u = (j + torch.rand(B, generator=generator, device=dev, dtype=torch.float64)) / k
                i = 1 + (u * steps).long().clamp(max=steps - 1)
            err = (xb - x0_hat(i)).flatten(1).pow(2).sum(1)
            total += 0.5 * (snr_prev[i] - snr[i]) * err
        parts["diffusion"].append(total * steps / k)
        # decoder at i = 0: mean x̂0, variance 1/SNR_0
        t0 = torch.zeros(B, dtype=torch.long, device=dev)
        mean = x0_hat(t0)
        log_scale = -0.5 * torch.log(snr[0])
        if discrete:
            ll = _log_discretized_gaussian(xb, mean, log_scale.expand_as(xb))
        else:
            ll = -0.5 * ((xb - mean) ** 2 * snr[0] + math.log(2 * math.pi) + 2 * log_scale)
        parts["decoder"].append(-ll.flatten(1).sum(1))
    to_bits = 1.0 / (D * math.log(2))
    out = {k: float(torch.cat(v).mean()) * to_bits for k, v in parts.items()}
    out["bpd"] = out["prior"] + out["diffusion"] + out["decoder"]
    return out


# -- evaluating a run ----------------------------------------------------------------------------
def resolve_extractor(cfg) -> str:
    ex = cfg.eval.extractor
    if ex != "auto":
        return ex
    if cfg.data.name == "digits":
        return "fasttrain-digits"
    return "inception-v3-compat" if cfg.data.name == "folder" else "none"


def _images(cfg, trainer, n: int, split: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Real data for a run: `train` for FID references, `test` (held out where there is one) for bpd."""
    from .data import TOYS, digits, toy
    from .data.folder import ImageFolderDataset, LatentFolderDataset
    from .data.manifest import load_manifest

    d = cfg.data
    if d.name == "digits":
        x, y = digits(d.image_size, split, holdout=d.holdout)
    elif d.name in TOYS:
        x, y = toy(d.name, n=n, seed=0 if split == "train" else 1), None
    else:  # folders: no held-out split of their own, the first n items (images unflipped)
        m = load_manifest(d.root, d.manifest)
        ds = (LatentFolderDataset(d.root, m) if d.name == "latents"
              else ImageFolderDataset(d.root, d.image_size, d.channels, flip=False, manifest=m))
        items = [ds[i] for i in range(min(n, len(ds)))]
        x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
    return x[:n], None if y is None else y[:n]


def run_evaluation(trainer, seed: int = 1234) -> dict:
    """FID/KID/precision/recall of EMA samples against the training data, the digits judge, and the
    held-out negative ELBO in bits/dim, as configured in `cfg.eval`."""
    cfg, ec, out = trainer.cfg, trainer.cfg.eval, {}
    extractor = resolve_extractor(cfg)
    classes = trainer.num_classes
    if ec.num_samples and trainer.info.image_size and extractor != "none":
        labels = torch.arange(ec.num_samples, device=trainer.device) % classes if classes else None
        x = trainer.generate(ec.num_samples, labels, seed=seed, steps=ec.steps, progress=False)
        ref, _ = _images(cfg, trainer, 5000, "train")
        try:
            out.update(fidelity(x, ref, extractor, ec.weights_path))
        except Exception as e:  # e.g. Inception weights that cannot be downloaded: report, keep training
            out["fidelity_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if extractor == "fasttrain-digits":
            from .features import judge

            out.update({f"digits_{k}": v for k, v in judge(x, labels).items()})
    if ec.bpd:
        x0, y = _images(cfg, trainer, ec.bpd_samples, "test")
        if classes and cfg.model.label_dropout > 0:  # the unconditional model, p(x)
            y = torch.full((len(x0),), classes, dtype=torch.long)
        elif not classes:
            y = None
        g = torch.Generator(trainer.device).manual_seed(seed)
        with trainer.ema.applied(trainer.model):
            res = nelbo_bits_per_dim(trainer.net.eval(), trainer.schedule, cfg.diffusion.prediction,
                                     x0.to(trainer.device), labels=None if y is None else y.to(trainer.device),
                                     n_t=ec.bpd_timesteps,
                                     discrete=trainer.info.image_size is not None and cfg.data.name != "latents",
                                     generator=g)
        trainer.model.train()
        out.update({"bpd": res["bpd"], "bpd_prior": res["prior"], "bpd_diffusion": res["diffusion"],
                    "bpd_decoder": res["decoder"]})
    return out
