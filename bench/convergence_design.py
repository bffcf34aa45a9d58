"""The design of the convergence study (bench/convergence.py): its domains, the tables (batch sizes)
and horizons, the seeds, the evaluations, and which arms each table runs by default and in the full
set; every run's config overrides. Numbers that set its cost and noise come from the pilot
(bench/convergence_pilot.py, bench/results/convergence-pilot.md).
"""
from __future__ import annotations

from pathlib import Path

from convergence_arms import Arm

RUNS = Path(__file__).parents[1] / "runs" / "convergence"  # training runs: outside the source tree

TARGETS = (0.25, 0.5, 1.0)
MIN_UPDATES = 300   # adaptive arms: policy updates in a run
NULL_OFFSET = 100   # the null seeds: s + 100 for every main seed s (independent of them; at most 100 seeds)
NOISE_EVALS = 8     # evaluations of one fixed network that measure the metric's own noise

COMMON = ["diffusion.prediction=eps", "diffusion.weighting=simple", "diffusion.sampler=uniform", "train.threads=1",
          "train.progress=false", "train.ckpt_every=0", "sample.num=0", "eval.bpd=false", "train.log_every=100",
          "diagnostics.interference_every=0", "optim.warmup_steps=200", "train.plots=false", "eval.at_start=true"]

# The arms of each table. Default (design 4): the post-hoc EMA and alignment arms with their controls, the
# third pass's strongest arm (mixed prediction + Min-SNR-5) with its controls, the arms the third pass did not
# re-measure under its rules, and the best combination (stage 2); the pilot's projection of its wall time is
# in docs/convergence.md. Full: `--full`, every arm. `confirm`: the domain whose first table chooses the
# combination arm and confirms its strongest arm on the null seeds (where the README makes that claim).
EXTRAS = ("input_perturbation", "pseudo_huber_snr", "immiscible")
NEW = ("phema", "align", "align_random")  # issue 45's levers and the alignment's control
UNMEASURED = ("logit_normal", "loss_second_moment", "adaptive_official", "edm2_learned_alone") + EXTRAS
DIGITS_16 = ("baseline", "min_snr_eps", "min_snr_v", "mixed_min_snr") + NEW + UNMEASURED
DIGITS_16_FULL = DIGITS_16 + ("edm2", "edm2_optimizer", "mixed_min_snr_noaux", "speed", "mixed_snr", "edm2_full",
                              "adaptive")
DIGITS_4_FULL = ("baseline", "min_snr_eps", "min_snr_v", "mixed_snr", "mixed_min_snr", "mixed_min_snr_noaux")
TWO_D = ("baseline", "min_snr_eps", "min_snr_v", "adaptive", "mixed_min_snr")
TWO_D_FULL = TWO_D + ("speed", "edm2", "edm2_optimizer", "edm2_full", "logit_normal", "loss_second_moment",
                      "adaptive_official", "mixed_snr", "mixed_min_snr_noaux")

DOMAINS = {
    "digits": dict(base=COMMON + ["data.name=digits", "model.name=unet_tiny", "model.args.ch=16", "optim.lr=1e-3",
                                  "eval.steps=20", "eval.extra_extractors=[fasttrain-digits-cnn]"],
                   metric="fid", label="FID (digits features)", batches={16: 960, 4: 960}, seeds=10, eval_n=512,
                   metric2="fid_fasttrain_digits_cnn", label2="FID (the second evaluator's features: digits CNN)",
                   arms={16: DIGITS_16}, full={16: DIGITS_16_FULL, 4: DIGITS_4_FULL}, confirm=True),
    "checkerboard": dict(base=COMMON + ["data.name=checkerboard", "model.name=mlp", "optim.lr=2e-3", "eval.steps=50"],
                         metric="sw2", label="sliced W2 to the true density", batches={128: 600}, seeds=10,
                         eval_n=4000, arms={128: TWO_D}, full={128: TWO_D_FULL}, confirm=False),
}


def null_seeds(seeds: list[int]) -> list[int]:
    return [s + NULL_OFFSET for s in seeds]


def run_dir(domain: str, batch: int, arm: str, seed: int, root: Path = RUNS) -> Path:
    return root / domain / f"b{batch}" / arm / f"seed{seed}"


def overrides(domain: str, arm: Arm, name: str, batch: int, seed: int, steps: int, evals: int, root: Path = RUNS,
              eval_n: int | None = None) -> list[str]:
    """A run's config: the domain's baseline, the arm, and the run's batch, seed, horizon and evaluations
    (at the start and every steps/evals steps, with the seed's own sampling seed)."""
    d = DOMAINS[domain]
    over = d["base"] + list(arm.overrides) + [
        f"data.batch_size={batch}", f"train.seed={seed}", f"train.steps={steps}", f"eval.every={steps // evals}",
        f"eval.num_samples={eval_n or d['eval_n']}", f"eval.seed={seed}",
        f"run_dir={run_dir(domain, batch, name, seed, root)}"]
    if arm.snapshots:  # post-hoc EMA snapshots at every evaluation step (and between): bench/convergence_phema.py
        e = max(1, steps // evals)  # every evaluation step must be a snapshot step
        over.append(f"phema.every={e // 2 if e % 2 == 0 else e}")
    if arm.adaptive:  # enough policy updates to learn something: ≥ MIN_UPDATES in the run
        # (chunk: probe elements per no-grad forward; 256 was ~15% faster than 4 micro-batches (64) on one CPU thread)
        over += [f"diffusion.sampler_args.every={max(1, steps // MIN_UPDATES)}", "diffusion.sampler_args.chunk=256"]
    return over
