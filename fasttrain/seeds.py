"""Every seed of a run, derived from the one `train.seed` by purpose (and rank, where streams must
differ per process): a keyed hash, so streams are independent whatever the numbers, and adding a new
purpose never shifts an old one.

    weights      model initialisation (the same on every rank)
    data         the order of the data, per epoch (the same on every rank; ranks take their shard)
    augment      per-sample augmentation draws (flips, crops) per epoch and rank
    timesteps    timestep sampling (per rank)
    noise        the Philox noise stream of the kernels (per rank)
    reseed       fresh per-rank streams when a run resumes on another number of processes (per step)
    policy       learned samplers' own parameters (the same on every rank)
    eval         sampling for evaluation and generation (but the first chunk of samples, whose noise comes
                 from the seed itself, as a diffusers pipeline given torch.Generator().manual_seed(seed) draws it;
                 `sample` and `eval` seed image i with seed + i instead, as EDM2 does: generation/ranks.py)
    probe        the adaptive sampler's look-ahead draws (τ-grid, x0* choice, probe noise per rank)
    posterior    draws from VAE posteriors stored with latents (per rank and data position)
    logvar       the learned log-variance layer's Fourier features and initial weight (the same on every rank)
    labels       label dropout for classifier-free guidance (per rank; conditioning.py)
    lora_dropout the global stream peft's LoRA dropout draws from (per rank; train.py, lora.py)
"""
from __future__ import annotations

import hashlib

PURPOSES = ("weights", "data", "augment", "timesteps", "noise", "reseed", "policy", "eval", "probe", "posterior",
            "logvar", "labels", "lora_dropout")


def derive(seed: int, purpose: str, *ids: int) -> int:
    """A 63-bit seed for (seed, purpose, ids...), e.g. derive(s, "noise", rank)."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown seed purpose {purpose!r}; add it to fasttrain/seeds.py")
    key = ":".join([str(int(seed)), purpose] + [str(int(i)) for i in ids]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
