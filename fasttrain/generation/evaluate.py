"""Evaluation of a model bundle: FID, KID and precision/recall through torch-fidelity, the digits judge,
and the negative ELBO in bits/dim (fasttrain/diffusion/nelbo.py).

Feature extractors: "fasttrain-digits" (the project's own digits classifier, offline: features.py) for
the built-in digits, and torch-fidelity's Inception ("inception-v3-compat") for real images, with
`weights_path` for machines that cannot download its weights. The reference data come from the run's
data kind (data/kinds.py: the built-in data sets, or a folder: the run's `data.root` if it still
exists, or `--ref PATH`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from ..data.kinds import Reference
from ..diffusion.nelbo import nelbo_bits_per_dim
from ..errors import InvalidInput, UserError

EXTRACTORS = ("auto", "fasttrain-digits", "fasttrain-digits-cnn", "inception-v3-compat", "none")


@dataclass
class EvalSettings:
    num_samples: int = 500
    steps: int = 50
    solver: str = "ddim"
    extractor: str = "auto"
    weights_path: str | None = None
    bpd: bool = True
    bpd_samples: int = 400
    bpd_timesteps: int = 50
    seed: int = 1234
    extra_extractors: tuple = ()  # FID in these features too, on the same samples: metrics fid_<name>

    def __post_init__(self):
        for key in ("num_samples", "bpd_samples"):
            if getattr(self, key) < 0:
                raise InvalidInput(f"eval.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("steps", "bpd_timesteps"):
            if getattr(self, key) < 1:
                raise InvalidInput(f"eval.{key} must be >= 1, got {getattr(self, key)}")
        if self.extractor not in EXTRACTORS:
            raise InvalidInput(f"unknown extractor {self.extractor!r}; choose from {', '.join(EXTRACTORS)}")
        for x in self.extra_extractors:
            if x not in EXTRACTORS[1:-1]:
                raise InvalidInput(f"bad value for 'eval.extra_extractors': {x!r} (choose from "
                                   f"{', '.join(EXTRACTORS[1:-1])})")

    @classmethod
    def from_config(cls, cfg) -> EvalSettings:
        e = cfg.eval
        return cls(e.num_samples, e.steps, cfg.sample.solver, e.extractor, e.weights_path, e.bpd, e.bpd_samples,
                   e.bpd_timesteps, e.seed, tuple(e.get("extra_extractors", ())))


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
             weights_path: str | None = None, prc: bool = True, kid: bool = True) -> dict:
    """FID, KID (mean ± std) and precision/recall of `samples` against `reference` (images in [-1, 1]);
    `kid=False`, `prc=False`: FID alone (KID's 100 subsets cost ~15× the FID of 512 digits on one thread)."""
    import torch_fidelity

    if extractor == "fasttrain-digits":
        from .features import _register

        _register()
    elif extractor == "fasttrain-digits-cnn":  # the second, independent digits evaluator
        from .digits_cnn import register

        register()
    kwargs = dict(input1=UInt8Images(samples), input2=UInt8Images(reference), cuda=torch.cuda.is_available(),
                  fid=True, kid=kid, prc=prc, feature_extractor=extractor, verbose=False, cache=False,
                  save_cpu_ram=True, kid_subset_size=min(len(samples), len(reference), 1000), batch_size=256)
    if weights_path:
        kwargs["feature_extractor_weights_path"] = weights_path
    m = torch_fidelity.calculate_metrics(**kwargs)
    out = {"fid": m["frechet_inception_distance"]}
    if kid:
        out["kid"], out["kid_std"] = m["kernel_inception_distance_mean"], m["kernel_inception_distance_std"]
    if prc:
        out["precision"], out["recall"] = m["precision"], m["recall"]
    return out


def extra_key(extractor: str) -> str:
    """The metric name of FID in another extractor's features: fid_fasttrain_digits_cnn."""
    return "fid_" + extractor.replace("-", "_")


# -- reference data --------------------------------------------------------------------------------
def reference_for(cfg, spec, ref_path: str | None = None, n: int = 5000) -> Reference:
    """The real data evaluations compare with, as the run's data kind provides it (data/kinds.py):
    built-in data from the config; folders from `ref_path`, else the run's data.root if it exists."""
    from ..data import data_kind

    return data_kind(spec.name).reference(cfg, spec, ref_path, n)


# -- evaluating a bundle -------------------------------------------------------------------------
def resolve_extractor(extractor: str, spec) -> str:
    if extractor != "auto":
        return extractor
    if spec.traits.extractor:  # the data kind's own (digits: the offline digits extractor)
        return spec.traits.extractor
    return "inception-v3-compat" if spec.is_images or spec.decodes else "none"


def run_evaluation(bundle, settings: EvalSettings, reference: Reference) -> dict:
    """FID/KID/precision/recall of EMA samples against the reference's training data, the digits
    judge, and the held-out negative ELBO in bits/dim (with its standard error)."""
    out, spec = {}, bundle.spec
    extractor = resolve_extractor(settings.extractor, spec)
    classes = spec.num_classes
    decodes = bundle.decodes  # VAE latents: judged as the images they decode into
    if settings.num_samples and (spec.is_images or decodes) and extractor != "none":
        if reference.train is None:
            out["fidelity_error"] = f"no reference images: {reference.source}"
        else:
            labels = torch.arange(settings.num_samples, device=bundle.device) % classes if classes else None
            prompts = {}
            if spec.text is not None:  # text runs: the data's evaluation prompts (digits-text: one per class)
                prompts = {"prompts": spec.text["prompts"], "negative_prompt": bundle.cfg.sample.negative_prompt}
                labels = torch.arange(settings.num_samples, device=bundle.device) % len(spec.text["prompts"])
            x = bundle.generate(settings.num_samples, labels, seed=settings.seed, steps=settings.steps,
                                solver=settings.solver, guidance=bundle.cfg.sample.guidance if prompts else 1.0,
                                **prompts)
            try:
                x = bundle.decode(x) if decodes else x
            except UserError as e:  # the VAE is gone or unusable: the rest of the evaluation goes on
                out["fidelity_error"] = str(e)
                x = None
            try:
                out.update(fidelity(x, reference.train, extractor, settings.weights_path) if x is not None else {})
                for extra in settings.extra_extractors if x is not None else ():  # the same samples, other features
                    out[extra_key(extra)] = fidelity(x, reference.train, extra, settings.weights_path, prc=False,
                                                              kid=False)["fid"]
            except Exception as e:  # e.g. Inception weights that cannot be downloaded
                out["fidelity_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if extractor == "fasttrain-digits" and x is not None:
                from .features import judge

                out.update({f"digits_{k}": v for k, v in judge(x, labels).items()})
    if settings.num_samples and not spec.image_size and reference.test is not None:  # 2-D points: exact metric
        n = min(settings.num_samples, len(reference.test))
        x = bundle.generate(n, None, seed=settings.seed, steps=settings.steps, solver=settings.solver)
        out["sw2"] = sliced_w2(x, reference.test[:n].to(x.device), seed=settings.seed)
    if settings.bpd and reference.test is not None and settings.bpd_samples:
        x0 = reference.test[: settings.bpd_samples].to(bundle.device)
        y = None
        if classes and spec.label_dropout > 0:  # the unconditional model, p(x)
            y = torch.full((len(x0),), classes, dtype=torch.long, device=bundle.device)
        elif classes:  # trained only conditionally: p(x | y) with the true labels, or nothing
            if reference.test_labels is None:
                return {**out, "bpd_error": "a conditional-only model needs labelled held-out data"}
            y = reference.test_labels[: len(x0)].to(bundle.device)
        g = torch.Generator(bundle.device).manual_seed(settings.seed)
        with bundle.averaged():
            res = nelbo_bits_per_dim(bundle.x0_hat, bundle.schedule, x0, labels=y, n_t=settings.bpd_timesteps,
                                     discrete=spec.is_images, generator=g)
        out.update({"bpd": res["bpd"], "bpd_se": res["bpd_se"], "bpd_prior": res["prior"],
                    "bpd_diffusion": res["diffusion"], "bpd_decoder": res["decoder"]})
    return out


def sliced_w2(x: torch.Tensor, y: torch.Tensor, projections: int = 1024, seed: int = 0) -> float:
    """Sliced Wasserstein-2 distance between two equal-size point sets (Rabin et al. 2011; Bonneel et al.
    2015): SW2² = E_θ[W2²(θᵀx, θᵀy)] over directions θ uniform on the sphere, each 1-D W2² exact from the
    sorted projections; `projections` seeded directions (float64)."""
    if x.shape != y.shape or x.ndim != 2:
        raise ValueError(f"sliced_w2 needs two [N, D] sets of equal size, got {tuple(x.shape)} and {tuple(y.shape)}")
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(projections, x.shape[1], generator=g, dtype=torch.float64)
    theta = (theta / theta.norm(dim=1, keepdim=True)).to(x.device)
    # [projections, N] rows, sorted along the contiguous last dim (twice as fast as sorting columns)
    px, py = (theta @ x.double().T).sort(-1).values, (theta @ y.double().T).sort(-1).values
    return float(((px - py) ** 2).mean().sqrt())


class RunEvaluation:
    """A training run's evaluation of its bundle, as the periodic action and the end of the run call it:
    `()` → the metrics of `run_evaluation`, inside `threads()` (parallel/cpu.evaluation_threads: every core
    of a one-process CPU run), with the reference data read once, on first use. Every rank calls it (FSDP
    forwards are collective)."""

    def __init__(self, bundle, settings: EvalSettings, cfg, threads=contextlib.nullcontext):
        self.bundle, self.settings, self.cfg, self.threads = bundle, settings, cfg, threads
        self._reference: Reference | None = None

    def reference(self) -> Reference:
        """The run's reference data (`reference_for`), read (and for folders decoded) once."""
        if self._reference is None:
            self._reference = reference_for(self.cfg, self.bundle.spec)
        return self._reference

    def __call__(self) -> dict:
        with self.threads():
            return run_evaluation(self.bundle, self.settings, self.reference())
