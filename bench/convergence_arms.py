"""The arms of the convergence study (bench/convergence.py): each strategy as its source trains it,
with the recipe and the source named, and the arms it is compared with besides the baseline.

An arm is config overrides on top of its domain's baseline. `kind` says which knob it turns (for the
choice of the combination arm); `controls` name the arms it differs from in one knob only, besides the
baseline (the table reports the arm against the baseline and against each of them). A post-hoc EMA arm
(`posthoc`) is evaluated from its runs' snapshots with the EMA length chosen on the main seeds
(bench/convergence_phema.py); `runs` names the arm whose runs it evaluates (the post-hoc EMA arm is the
baseline's own runs, which write snapshots: `snapshots`, and train exactly as without them).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arm:
    overrides: tuple[str, ...]
    kind: str                 # base | weighting | sampler | both | prediction | optimizer | noise | loss | diagnostic
    #                           | combo
    recipe: str               # what it trains with, in words
    source: str               # where the recipe comes from
    controls: tuple[str, ...] = ()
    adaptive: bool = False    # report policy updates and the drift of p(t)
    needs: tuple[str,
                 ...] = field(default=())  # config keys it needs (an arm whose keys this version lacks is left out)
    snapshots: bool = False   # its runs write post-hoc EMA snapshots (phema.every: convergence_design.overrides)
    posthoc: bool = False     # evaluated with the post-hoc EMA of the σ_rel chosen on the main seeds
    runs: str | None = None   # the arm whose runs it evaluates (None: its own)


EDM2 = ("diffusion.prediction=v", "diffusion.weighting=edm", "diffusion.weighting_args.sigma_data=0.5",
        "diffusion.sampler=lognormal", "diffusion.sampler_args.p_mean=-0.8", "diffusion.sampler_args.p_std=1.6",
        "diffusion.learned_weighting=true", "diffusion.logvar_layer=edm2")
EDM2_OPTIMIZER = ("optim.grad_clip=0", "optim.betas=[0.9,0.99]")
MIXED_MIN_SNR = ("diffusion.prediction=mixed", "diffusion.weighting=min_snr", "diffusion.weighting_args.gamma=5")

BASELINE = Arm((), "base", "uniform t, ε-prediction, unweighted ε-MSE (≡ SNR-weighted x0-MSE); fixed EMA (0.999, "
               "warm-up)", "Ho et al. 2020 (DDPM)", snapshots=True)
# REPA on the digits UNet: its 3rd of 8 blocks (the 4×4 stage after the first downsampling, about as early as
# REPA's block 8 of 28), a head of width 256 (REPA: 2048 for SiT-XL's 1152 channels), λ 0.5 (REPA's default)
ALIGN = ("diffusion.align.depth=3", "diffusion.align.projector_dim=256", "diffusion.align.weight=0.5")

ARMS: dict[str, Arm] = {
    "baseline": BASELINE,
    "min_snr_eps": Arm(("diffusion.weighting=min_snr", "diffusion.weighting_args.gamma=5"), "weighting",
                       "ε, Min-SNR-5: x0-space weight min(SNR, 5)", "Hang et al. 2023, official weights for ε"),
    "min_snr_v": Arm(("diffusion.prediction=v", "diffusion.weighting=min_snr", "diffusion.weighting_args.gamma=5"),
                     "weighting", "v, Min-SNR-5", "Hang et al. 2023 (their best: v + Min-SNR-5)"),
    "speed": Arm(("diffusion.sampler=speed", "diffusion.weighting=speed"), "both",
                 "SpeeD asymmetric sampling (k=5, τ=700, dual) + change-aware weighting",
                 "Wang et al. 2024, official `ours` setting"),
    "loss_second_moment": Arm(("diffusion.sampler=loss_second_moment",), "sampler",
                              "importance sampling by the loss's second moment (history 10)",
                              "Nichol & Dhariwal 2021 (iDDPM resample.py)"),
    "logit_normal": Arm(("diffusion.sampler=logit_normal",), "sampler", "logit-normal t (0, 1)",
                        "Esser et al. 2024 (SD3)"),
    # EDM2's recipe under the baseline's optimizer settings (gradient clipping 1, Adam β2 0.999), and EDM2's
    # optimizer change as its own arm, so that neither is credited with the other's effect
    "edm2": Arm(EDM2, "weighting",
                "log-normal σ (P_mean −0.8, P_std 1.6), EDM weighting λ(σ) (σ_data 0.5), learned log-variance through "
                "EDM2's MPFourier + MPConv (random init from the run's seed, forced weight normalization), "
                "v-parametrised output; the baseline's optimizer",
                "Karras et al. 2024 (NVlabs/edm2: training_loop.EDM2Loss, networks_edm2.Precond, img64 P_mean/P_std)",
                needs=("diffusion.logvar_layer",)),
    "edm2_optimizer": Arm(EDM2_OPTIMIZER, "optimizer", "EDM2's optimizer settings alone: no gradient clipping, "
                          "Adam β2 0.99", "Karras et al. 2024 (NVlabs/edm2 training_loop: Adam betas (0.9, 0.99), "
                          "no clipping)"),
    "edm2_full": Arm(EDM2 + EDM2_OPTIMIZER, "weighting", "EDM2's recipe (the edm2 arm) with EDM2's optimizer settings "
                     "(no gradient clipping, Adam β2 0.99)", "Karras et al. 2024", controls=("edm2",),
                     needs=("diffusion.logvar_layer",)),
    "edm2_learned_alone": Arm(("diffusion.learned_weighting=true",), "diagnostic",
                              "diagnostic: the learned log-variance (zero-init linear) alone, on uniform t and ε-MSE",
                              "fasttrain's earlier edm2 arm (not EDM2's recipe)"),
    "adaptive": Arm(("diffusion.sampler=adaptive",), "sampler", "learned policy π(t|x0), fasttrain's defaults "
                    "(τ-grid 16 strata) with a shorter look-ahead period for ≥ 300 policy updates",
                    "Kim et al. 2024 (ku-dmlab/Adaptive-Timestep-Sampler)", adaptive=True),
    "adaptive_official": Arm(("diffusion.sampler=adaptive", "diffusion.sampler_args.tau_grid=0"), "sampler",
                             "learned policy, the official τ-grid (all T timesteps) with a shorter look-ahead period "
                             "for ≥ 300 policy updates", "Kim et al. 2024, official train.py", adaptive=True),
    "mixed_snr": Arm(("diffusion.prediction=mixed", "diffusion.weighting=snr"), "prediction",
                     "mixed prediction (ε, x0, v; pixel gate) under the baseline's weighting (x0-space SNR ≡ ε-MSE)",
                     "Xie & Agam 2025"),
    # against Min-SNR-5 with ε (the prediction it adds heads to) and with v (Min-SNR's best setting): the
    # same x0-space weight min(SNR, 5) in every one, so each pair differs in the prediction alone
    "mixed_min_snr": Arm(MIXED_MIN_SNR, "prediction", "mixed prediction under Min-SNR-5", "Xie & Agam 2025",
                         controls=("min_snr_eps", "min_snr_v")),
    # the mixed loss adds aux_weight × each head's own-space MSE (lucidrains' 0.1): off, the arm differs from
    # mixed_min_snr in that alone
    "mixed_min_snr_noaux": Arm(MIXED_MIN_SNR + ("diffusion.mixed.aux_weight=0",), "prediction",
                               "mixed prediction under Min-SNR-5 without the per-head auxiliary losses",
                               "ablation of the mixed loss's aux terms", controls=("mixed_min_snr",)),
    "input_perturbation": Arm(("diffusion.noise.perturbation=0.1",), "noise",
                              "input perturbation γ = 0.1 (x_t from ε + γξ, target ε)",
                              "Ning et al. 2023; diffusers --input_perturbation", needs=("diffusion.noise",)),
    "pseudo_huber_snr": Arm(("diffusion.loss.type=huber", "diffusion.loss.huber_schedule=snr",
                             "diffusion.loss.huber_c=0.1"), "loss",
                            "scheduled pseudo-Huber loss 2c(√(d²+c²)−c), SNR schedule, c = 0.1",
                            "Khrapov & Popov 2024; sd-scripts --loss_type huber --huber_schedule snr",
                            needs=("diffusion.loss",)),
    "immiscible": Arm(("diffusion.noise.immiscible=assignment",), "noise",
                      "immiscible noise: batch-wise linear assignment of noise to images",
                      "Li et al. 2024 (official Linear_Assignment code)", needs=("diffusion.noise",)),
    # the baseline's runs evaluated with the post-hoc EMA: the same training, another average of its weights
    "phema": Arm((), "ema", "post-hoc EMA: the baseline's runs, averaged with the power-function EMA of the σ_rel "
                 "chosen on the main seeds (lowest median end FID of 0.03–0.23), reconstructed from snapshots of "
                 "σ_rel 0.05 and 0.10 every half evaluation interval",
                 "Karras et al. 2024 (EDM2 §3; NVlabs/edm2 training/phema.py)", controls=("baseline",),
                 posthoc=True, runs="baseline", snapshots=True, needs=("phema.every",)),
    "align": Arm(("diffusion.align.encoder=fasttrain.pretrained.digits_encoder:encoder",) + ALIGN, "align",
                 "REPA: the UNet's 3rd block aligned (3-layer MLP head, width 256, −cos, λ 0.5) to the project's "
                 "SimCLR digits encoder (16 patch tokens × 64; trained without labels on held-out digits no "
                 "evaluator sees)", "Yu et al. 2024 (sihyun-yu/REPA loss.py, models/sit.py, train.py)",
                 controls=("align_random",), needs=("diffusion.align.encoder",)),
    "align_random": Arm(("diffusion.align.encoder=fasttrain.pretrained.digits_encoder:random_encoder",) + ALIGN,
                        "diagnostic", "control: the same alignment to the same encoder architecture with random "
                        "weights (the auxiliary loss without a learned representation)",
                        "one-knob control of the align arm", needs=("diffusion.align.encoder",)),
}

# Which arms are candidates for the two halves of the combination (the strongest arm of any knob but the
# sampler, mixed included; the best sampler arm), chosen by the script at the first batch size from the
# arms of the invocation that chooses it (bench/convergence.py: the default arms).
COMBINABLE = ("weighting", "both", "prediction", "noise", "loss")
ADDITIVE = ("align", "ema")  # levers added to the combination where they beat the baseline (median > 1 at 100%)
KNOBS = COMBINABLE + ("sampler", "optimizer", "combo") + ADDITIVE  # may be the strongest arm (not diagnostics)


def available(arms: dict[str, Arm], has_key) -> dict[str, Arm]:
    """The arms whose config keys this version has (`has_key(key) -> bool`)."""
    return {n: a for n, a in arms.items() if all(has_key(k) for k in a.needs)}


def combination(results: dict, arms: dict[str, Arm]) -> tuple[str, Arm] | None:
    """The best combination: the strongest non-sampler arm with the best sampler arm, by the median steps
    ratio at the full-run target (sampler settings of the second added to the first), and with each
    additive lever (alignment, post-hoc EMA) whose best arm beat the baseline there (median > 1)."""
    def best(kinds, above=None):
        cands = [(r["targets"]["1.0"]["median"], a) for a, r in results.items()
                 if a in arms and arms[a].kind in kinds and r["targets"]["1.0"]["median"] is not None
                 and (above is None or r["targets"]["1.0"]["median"] > above)]
        return max(cands)[1] if cands else None

    strong, sampler = best(COMBINABLE), best(("sampler",))
    if not strong or not sampler:
        return None
    s_over = tuple(o for o in arms[sampler].overrides if o.startswith("diffusion.sampler"))
    over = tuple(o for o in arms[strong].overrides if not o.startswith("diffusion.sampler")) + s_over
    names, recipes = [strong, sampler], [arms[strong].recipe, arms[sampler].recipe]
    posthoc = False
    for kind in ADDITIVE:
        extra = best((kind,), above=1.0)
        if extra:
            over += arms[extra].overrides
            posthoc = posthoc or arms[extra].posthoc
            names.append(extra)
            recipes.append(arms[extra].recipe)
    return " + ".join(names), Arm(over, "combo", "; with ".join(recipes), "chosen by the script from the first "
                                  "batch's arms", adaptive=arms[sampler].adaptive, snapshots=posthoc, posthoc=posthoc)
