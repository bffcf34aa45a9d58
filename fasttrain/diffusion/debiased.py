"""Debiased estimation (Yu et al. 2023, "Debias the Training of Diffusion Models", arXiv 2310.08442) as
sd-scripts trains it (`--debiased_estimation_loss`, library/custom_train_functions.py,
`apply_debiased_estimation`): the per-sample loss of the network's own prediction is multiplied by

    eps:  1/sqrt(min(SNR, 1000))          (the paper's 1/sqrt(SNR) on the ε-MSE, SNR capped at 1000)
    v:    1/(min(SNR, 1000) + 1)          (its `--v_parameterization` variant, sd-scripts 2024-10)

with SNR = ᾱ/(1 - ᾱ) = alpha²/sigma², the schedule's SNR.

fasttrain defines weightings in x0 space and divides them by c(t) for the prediction type (weighting.py),
so the two source weights become two x0-space weights (c_p: c(t) of prediction p, prediction.py):

    variant "eps":  w_x0 = c_eps/sqrt(min(SNR, 1000))      (= sqrt(SNR) while SNR <= 1000)
    variant "v":    w_x0 = c_v/(min(SNR, 1000) + 1)        (= 1, the x0-MSE, on VP schedules while SNR <= 1000)

With prediction eps (variant "eps") the weight on the ε-MSE is then exactly sd-scripts' 1/sqrt(min(SNR, 1000)),
and with prediction v (variant "v") exactly its 1/(min(SNR, 1000) + 1) on the v-MSE. The two are different
objectives: sd-scripts picks one by the prediction type, and so does the default `variant="auto"` ("v" for
prediction v, "eps" for every other type). That makes `debiased` with "auto" the one weighting whose x0-space
weight depends on the prediction type (sd-scripts' semantics, kept on purpose); set `variant` to "eps" or
"v" to train the same objective with every prediction type.

SNR = 0 (a zero-terminal schedule's last step, the last flow step): sd-scripts' eps weight is 1/sqrt(0) = inf
there (it has no lower clamp; its v weight is 1/(0 + 1) = 1). fasttrain keeps its guard instead: every
weighting is 1 in the prediction's space where SNR = 0 (`loss_weight`, after the official Min-SNR code), so
the eps variant gives weight 1 at that step rather than inf; the v variant agrees with sd-scripts there.
sd-scripts computes its SNR table in float32; these tables are float64.
"""
from __future__ import annotations

import torch

from ..errors import InvalidInput
from . import prediction as P
from .weighting import register

SNR_CAP = 1000.0  # sd-scripts: `snr = torch.minimum(snr, torch.ones_like(snr) * 1000)`
VARIANTS = ("auto", "eps", "v")


@register("debiased")
def debiased(s, prediction, variant: str = "auto"):
    if variant not in VARIANTS:
        raise InvalidInput(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if variant == "auto":
        variant = "v" if prediction == "v" else "eps"
    snr = torch.clamp_max(s.snr, SNR_CAP)
    c = P.c_factor(variant, s.alpha, s.sigma)  # c(t) of the source's prediction: its weight times c is x0-space
    if variant == "eps":
        return c / torch.sqrt(snr)  # 0/0 where SNR = 0: loss_weight's guard sets 1 there
    return c / (snr + 1)
