"""Beta policies over the timestep for the adaptive sampler (Kim et al. 2024, arXiv 2411.09998, §4):
u ~ Beta(α, β), t = round(u·(T−1)), as the official `sample_timesteps` (ddpm_torch/utils/train.py).

  ConditionalBeta  (α, β) from x0 through a small net (the official `ActorNetwork`,
                   ddpm_torch/network.py:74-107, made resolution- and channel-agnostic): images and
                   latents are average-pooled to at most 8×8, three 3×3 convs (two of stride 2),
                   global average pooling, an MLP of depth 2; flat vectors ([B, D], 2-D toys) go
                   straight to the MLP. The official net flattens a 32×32 feature map and so only
                   takes 3×32×32 images; pooling first also keeps the per-step cost negligible.
  GlobalBeta       two parameters, the same (α, β) for every sample.

Both end in softplus(·) + 1e-5 with the last layer initialised to weight 0, bias 0.5 as the official
`_initialize_weights`, so α = β = softplus(0.5) ≈ 0.974 at the start: nearly uniform.

Beta log-density, entropy, sampling and bin masses are written out here (no torch.distributions
object: its argument validation reads tensors back to the host). Sampling uses
`torch._sample_dirichlet`, which takes a generator, so draws follow the trainer's generator.
`timestep_masses` integrates the density over each timestep's bin of u (quadrature inside, the
regularised incomplete beta function I_x(a, b) at the two singular ends), for the unbiased
importance weights and for plots of p(t).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidInput

INIT_BIAS = 0.5   # official `_initialize_weights`: α = β = softplus(0.5) + 1e-5 at the start
MIN_CONC = 1e-5   # official: softplus(·) + 1e-5 keeps α, β > 0
U_EPS = 1e-6      # draws are kept inside (0, 1) so that log π(u) stays finite when α or β < 1
POOL = 8          # images are average-pooled to at most POOL × POOL before the policy net


def _head(hidden: int) -> nn.Linear:
    head = nn.Linear(hidden, 2)
    nn.init.zeros_(head.weight)
    nn.init.constant_(head.bias, INIT_BIAS)
    return head


def _concentrations(out: torch.Tensor) -> torch.Tensor:
    """[..., 2] raw outputs → (α, β) as the last dimension (the Dirichlet sampler's input as it is)."""
    return F.softplus(out.float()) + MIN_CONC


class ConditionalBeta(nn.Module):
    """(α_b, β_b) = f_φ(x0_b) for x0 of shape `in_shape`: (C, H, W) images/latents or (D,) vectors.
    Returns the concentrations [B, 2]; `.unbind(-1)` gives α and β."""

    def __init__(self, in_shape: tuple[int, ...], width: int = 16, hidden: int = 64):
        super().__init__()
        self.in_shape = tuple(int(s) for s in in_shape)
        if len(self.in_shape) == 3:
            c = self.in_shape[0]
            self.trunk = nn.Sequential(
                nn.Conv2d(c, width, 3, padding=1), nn.ReLU(),
                nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.ReLU())
            feat = 4 * width
        elif len(self.in_shape) == 1:
            self.trunk = nn.Identity()
            feat = self.in_shape[0]
        else:
            raise InvalidInput(f"the adaptive policy takes [B, C, H, W] or [B, D] data, got per-sample "
                               f"shape {in_shape}")
        # official `mlp(input, hidden, hidden_depth=2, 2)`: Linear-ReLU-Linear-ReLU-Linear
        self.mlp = nn.Sequential(nn.Linear(feat, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 _head(hidden))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0.float()
        if x.ndim == 4:
            if x.shape[-1] > POOL or x.shape[-2] > POOL:
                x = F.adaptive_avg_pool2d(x, (min(x.shape[-2], POOL), min(x.shape[-1], POOL)))
            x = self.trunk(x).mean(dim=(-2, -1))  # global average pooling: any resolution
        return _concentrations(self.mlp(x))


class GlobalBeta(nn.Module):
    """One (α, β) for all samples: two parameters, softplus as above, initialised to the same values.
    Returns the concentrations [n, 2] (an expanded view)."""

    def __init__(self):
        super().__init__()
        self.raw = nn.Parameter(torch.full((2,), INIT_BIAS))

    def forward(self, x0: torch.Tensor | None = None, n: int = 1) -> torch.Tensor:
        n = n if x0 is None else x0.shape[0]
        return _concentrations(self.raw).expand(n, 2)


# -- Beta distribution ---------------------------------------------------------------------------
def log_prob(u: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """log Beta(u; a, b) = (a−1)·log u + (b−1)·log(1−u) − log B(a, b)."""
    lbeta = torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)
    return (a - 1) * torch.log(u) + (b - 1) * torch.log1p(-u) - lbeta


def entropy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """H[Beta(a, b)] = log B(a, b) − (a−1)ψ(a) − (b−1)ψ(b) + (a+b−2)ψ(a+b)."""
    lbeta = torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)
    return (lbeta - (a - 1) * torch.digamma(a) - (b - 1) * torch.digamma(b)
            + (a + b - 2) * torch.digamma(a + b))


def sample(conc: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """u ~ Beta(α, β) for concentrations [..., 2]: the first coordinate of a Dirichlet([α, β]) draw.
    (Clamp into [U_EPS, 1 − U_EPS] before taking log π(u): `clamp_u`.)"""
    return torch._sample_dirichlet(conc.detach().float(), generator)[..., 0]


def clamp_u(u: torch.Tensor) -> torch.Tensor:
    return u.clamp(U_EPS, 1 - U_EPS)


def to_timestep(u: torch.Tensor, T: int) -> torch.Tensor:
    """The official mapping t = round(u·(T−1))."""
    return torch.round(u * (T - 1)).long()


def _inc_beta_series(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, terms: int) -> torch.Tensor:
    """I_x(a, b) = x^a (1−x)^b / (a·B(a, b)) · Σ_n Π_{k<n} x(a+b+k)/(a+1+k) (the hypergeometric series
    of the incomplete beta function, DLMF 8.17.8 with 2F1(a+b, 1; a+1; x)), for x ≤ ½. The ratio of
    successive terms tends to x ≤ ½, after rising above 1 for at most ~b terms, so `terms` ≳ b + 60
    gives float64 accuracy. The terms are a cumulative sum of log-ratios along one extra dimension
    (all positive: no cancellation, no overflow), so the series costs a few kernels, not a loop."""
    k = torch.arange(terms - 1, dtype=x.dtype, device=x.device)
    x_, a_, b_ = x[..., None], a[..., None], b[..., None]
    log_ratio = torch.log(x_) + torch.log(a_ + b_ + k) - torch.log(a_ + 1 + k)
    lbeta = torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)
    log_pre = a * torch.log(x) + b * torch.log1p(-x) - lbeta - torch.log(a)
    log_terms = torch.cat([torch.zeros_like(x_), torch.cumsum(log_ratio, dim=-1)], dim=-1)
    return torch.exp(torch.logsumexp(log_terms, dim=-1) + log_pre)  # x = 0: exp(-inf) = 0


def cdf_pair(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, terms: int = 256):
    """(I_x(a, b), 1 − I_x(a, b)), each computed directly where it is the small one's side (no
    cancellation), through I_x(a, b) = 1 − I_{1−x}(b, a) for x > ½. float64; with 256 terms accurate to
    ~1e-13 for α, β ≤ 100 and ~1e-7 at 150 (tests/diffusion/test_adaptive.py against scipy), which
    covers any useful sampling policy (a Beta with α + β = 200 has a standard deviation < 0.035)."""
    x, a, b = torch.broadcast_tensors(x.double(), a.double(), b.double())
    x = x.clamp(0.0, 1.0)
    swap = x > 0.5
    xs, as_, bs = torch.where(swap, 1 - x, x), torch.where(swap, b, a), torch.where(swap, a, b)
    direct = _inc_beta_series(xs, as_, bs, terms)
    return torch.where(swap, 1 - direct, direct), torch.where(swap, direct, 1 - direct)


_GL_NODES, _GL_WEIGHTS = (torch.from_numpy(v) for v in np.polynomial.legendre.leggauss(8))


def _quadrature(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor, T: int) -> torch.Tensor:
    """8-point Gauss–Legendre quadrature of the normalised Beta density over each t's bin of u."""
    lo, hi = timestep_edges(T, t)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    nodes = mid[..., None] + half[..., None] * _GL_NODES.to(a.device)
    lbeta = torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)
    log_pdf = (a[..., None] - 1) * torch.log(nodes) + (b[..., None] - 1) * torch.log1p(-nodes) - lbeta[..., None]
    return half * (torch.exp(log_pdf) * _GL_WEIGHTS.to(a.device)).sum(-1)


def _end_masses(a: torch.Tensor, b: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """P(t = 0) = I_h(a, b) and P(t = T−1) = I_h(b, a) with h = ½/(T−1)."""
    h = torch.full_like(a, 0.5 / (T - 1))
    return cdf_pair(h, a, b)[0], cdf_pair(h, b, a)[0]


def timestep_masses(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor, T: int) -> torch.Tensor:
    """p(t | a, b) = P(round(u·(T−1)) = t) under Beta(a, b), broadcast over the arguments, float64.

    Interior bins (width 1/(T−1)): 8-point Gauss–Legendre quadrature of the normalised density,
    smooth there for any (a, b) whose standard deviation exceeds a bin (a + b below ~10⁶). The two
    end bins, where the density is singular for a < 1 or b < 1, come from the incomplete beta
    function at x = ½/(T−1), where its series converges in a few terms for any b up to ~10⁵."""
    a, b, t = torch.broadcast_tensors(a.double(), b.double(), t)
    first, last = _end_masses(a, b, T)
    return torch.where(t == 0, first, torch.where(t == T - 1, last, _quadrature(a, b, t, T)))


def timestep_edges(T: int, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The u-interval that t = round(u·(T−1)) maps to t: [(t−½)/(T−1), (t+½)/(T−1)] ∩ [0, 1]."""
    t = t.double()
    return ((t - 0.5) / (T - 1)).clamp(0, 1), ((t + 0.5) / (T - 1)).clamp(0, 1)


def timestep_probs(a: torch.Tensor, b: torch.Tensor, T: int, bins: int | None = None,
                   max_elements: int = 1 << 21) -> torch.Tensor:
    """Marginal p(t) of the Beta policies (a, b) [N] averaged over the N policies: [T] float64, or
    [bins] with bin k holding timesteps [⌊kT/bins⌋, ⌊(k+1)T/bins⌋) (summed per timestep first, so a
    policy narrower than a bin is still integrated exactly). Chunked over t to bound memory."""
    a, b = a.reshape(-1, 1).double(), b.reshape(-1, 1).double()
    per = max(1, max_elements // (a.shape[0] * 8))
    t = torch.arange(T, device=a.device)
    p = torch.cat([_quadrature(a, b, t[None, i:i + per], T).mean(0) for i in range(0, T, per)])
    first, last = _end_masses(a[:, 0], b[:, 0], T)
    p[0], p[-1] = first.mean(), last.mean()
    if bins is None:
        return p
    group = torch.div(t * bins, T, rounding_mode="floor")  # timestep t lies in bin ⌊t·bins/T⌋
    return torch.zeros(bins, dtype=p.dtype, device=p.device).index_add_(0, group, p)
