"""Prediction types: what the network outputs, as a linear combination of the noise and the data.

With x_t = a·x0 + s·eps (a = alpha[t], s = sigma[t]) every supported type regresses

    target = ce(t)·eps + cx(t)·x0          eps (1, 0), x0 (0, 1), v (a, -s) (Salimans & Ho 2022),
                                           flow (1, -1) (rectified-flow velocity eps - x0)

so a prediction type is its two coefficient tables, and everything else follows from them:
  * the fused loss kernel gathers coef = [ce, cx] by t (fasttrain.kernels: no per-type code paths);
  * conversion to (x̂0, ε̂) solves [x_t; pred] = [[a, s], [cx, ce]]·[x0; eps], determinant
    det = a·ce − s·cx:  x̂0 = (ce·x_t − s·pred)/det,  ε̂ = (a·pred − cx·x_t)/det;
  * c(t), which turns an x0-space MSE into this type's MSE at fixed x_t (Hang et al. 2023, §4):
    ‖pred − target‖² = c·‖x̂0 − x0‖² with c = (det/s)² (eps: SNR, x0: 1, v: (a²+s²)²/s², flow: (a+s)²/s²).
Where det = 0 (eps at a step with a = 0: zero-terminal SNR, the last flow step) x̂0 is undefined;
`conditioning(schedule)` exposes that so configs can refuse it.

A new prediction type is one class with `coefficients` that registers itself (`@register`).
"""
from __future__ import annotations

import torch

from ..registry import Registry

PREDICTIONS_REGISTRY = Registry("prediction")
register = PREDICTIONS_REGISTRY.register


class Prediction:
    name = "base"
    uses = (True, True)  # whether the target reads (eps, x0): lets the kernel skip a load

    @staticmethod
    def coefficients(a, s):
        """(ce, cx) with target = ce·eps + cx·x0; a, s are tensors (tables or per-sample columns)."""
        raise NotImplementedError

    # -- derived -------------------------------------------------------------------------------
    def table(self, alpha: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """[2, T] float32 coefficients for the kernels."""
        ce, cx = self.coefficients(alpha.double(), sigma.double())
        return torch.stack([torch.as_tensor(ce, dtype=torch.float64).expand_as(alpha),
                            torch.as_tensor(cx, dtype=torch.float64).expand_as(alpha)]).float()

    def det(self, a, s):
        ce, cx = self.coefficients(a, s)
        return a * ce - s * cx

    def target(self, x0, eps, a, s):
        ce, cx = self.coefficients(a, s)
        return ce * eps + cx * x0

    def to_x0_eps(self, pred, x_t, a, s):
        """(x̂0, ε̂) from a network output at x_t."""
        ce, cx = self.coefficients(a, s)
        det = a * ce - s * cx
        return (ce * x_t - s * pred) / det, (a * pred - cx * x_t) / det

    def c_factor(self, alpha, sigma) -> torch.Tensor:
        return self.det(alpha, sigma) ** 2 / sigma**2  # eps: exactly the schedule's SNR = a²/s²


@register("eps")
class Eps(Prediction):
    uses = (True, False)

    @staticmethod
    def coefficients(a, s):
        return torch.ones_like(a), torch.zeros_like(a)


@register("x0")
class X0(Prediction):
    uses = (False, True)

    @staticmethod
    def coefficients(a, s):
        return torch.zeros_like(a), torch.ones_like(a)


@register("v")
class V(Prediction):
    @staticmethod
    def coefficients(a, s):
        return a, -s


@register("flow")
class Flow(Prediction):
    @staticmethod
    def coefficients(a, s):
        return torch.ones_like(a), -torch.ones_like(a)


def get(name: str) -> Prediction:
    return PREDICTIONS_REGISTRY.build(name)


def names() -> tuple[str, ...]:
    return PREDICTIONS_REGISTRY.names()


def check(name: str) -> str:
    PREDICTIONS_REGISTRY.get(name)
    return name


# Functional forms (used by samplers, the NELBO and tests)
def target(name: str, x0, eps, a, s):
    return get(name).target(x0, eps, a, s)


def to_x0_eps(name: str, pred, x_t, a, s):
    a, s = torch.as_tensor(a, dtype=x_t.dtype, device=x_t.device), torch.as_tensor(s, dtype=x_t.dtype,
                                                                                   device=x_t.device)
    return get(name).to_x0_eps(pred, x_t, a, s)


def c_factor(name: str, alpha: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """c(t) per timestep (float64 tables in, [T] out); see the module docstring."""
    return get(name).c_factor(alpha, sigma)


def conditioning(name: str, schedule) -> torch.Tensor:
    """|det(t)| per timestep: 0 where x̂0 cannot be recovered from this prediction (see above)."""
    return get(name).det(schedule.alpha, schedule.sigma).abs()
