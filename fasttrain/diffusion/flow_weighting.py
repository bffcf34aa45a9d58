"""diffusers' SD3/Flux loss weightings on the flow-matching (velocity) MSE, as examples/dreambooth/
train_dreambooth_lora_flux.py applies them: `compute_loss_weighting_for_sd3(weighting_scheme, sigmas)` multiplies
(model_pred − (noise − latents))², the velocity error (L1817-1841 at diffusers 58eb52c):

  flow_sigma_sqrt  1/σ²                   --weighting_scheme sigma_sqrt
  flow_cosmap      2/(π(1 − 2σ + 2σ²))    --weighting_scheme cosmap

weighting.py's `sd3_sigma_sqrt` and `cosmap` are the same functions as x0-space weights: the weights of
train_dreambooth_lora_sd3.py, whose default --precondition_outputs turns the output into x̂0 and the loss
into an x0-space MSE. Flux's script has no preconditioning, so its weight sits on the velocity MSE, which is
the x0-space MSE times c_flow(t) = 1/σ² (prediction.py). fasttrain defines weightings in x0 space, so these
are w_x0 = w_flow · c_flow(t): with flow prediction the weight on the flow MSE is exactly diffusers'. At the
flow schedule's last step (σ = 1, SNR = 0) every weighting is 1 (weighting.loss_weight's guard): there
flow_sigma_sqrt agrees with diffusers (1/1²), flow_cosmap gives 1 where diffusers gives 2/π.
"""
from __future__ import annotations

import math

from . import prediction as P
from .weighting import register


def _flow_c(s):
    return P.c_factor("flow", s.alpha, s.sigma)


@register("flow_sigma_sqrt")
def flow_sigma_sqrt(s, prediction):
    return s.sigma ** -2.0 * _flow_c(s)


@register("flow_cosmap")
def flow_cosmap(s, prediction):
    return 2.0 / (math.pi * (1 - 2 * s.sigma + 2 * s.sigma**2)) * _flow_c(s)
