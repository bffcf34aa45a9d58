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
`bin_masses` integrates the density over timestep bins through the regularised incomplete beta
function I_x(a, b), for the unbiased importance weights and for plots of p(t).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INIT_BIAS = 0.5   # official `_initialize_weights`: α = β = softplus(0.5) + 1e-5 at the start
MIN_CONC = 1e-5   # official: softplus(·) + 1e-5 keeps α, β > 0
U_EPS = 1e-6      # draws are kept inside (0, 1) so that log π(u) stays finite when α or β < 1
POOL = 8          # images are average-pooled to at most POOL × POOL before the policy net


def _head(hidden: int) -> nn.Linear:
    head = nn.Linear(hidden, 2)
    nn.init.zeros_(head.weight)
    nn.init.constant_(head.bias, INIT_BIAS)
    return head


def _concentrations(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ab = F.softplus(out.float()) + MIN_CONC
    return ab[..., 0], ab[..., 1]


class ConditionalBeta(nn.Module):
    """(α_b, β_b) = f_φ(x0_b) for x0 of shape `in_shape`: (C, H, W) images/latents or (D,) vectors."""

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
            raise ValueError(f"the adaptive policy takes [B, C, H, W] or [B, D] data, got per-sample shape {in_shape}")
        # official `mlp(input, hidden, hidden_depth=2, 2)`: Linear-ReLU-Linear-ReLU-Linear
        self.mlp = nn.Sequential(nn.Linear(feat, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), _head(hidden))

    def forward(self, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.float()
        if x.ndim == 4:
            if x.shape[-1] > POOL or x.shape[-2] > POOL:
                x = F.adaptive_avg_pool2d(x, (min(x.shape[-2], POOL), min(x.shape[-1], POOL)))
            x = self.trunk(x).mean(dim=(-2, -1))  # global average pooling: any resolution
        return _concentrations(self.mlp(x))


class GlobalBeta(nn.Module):
    """One (α, β) for all samples: two parameters, softplus as above, initialised to the same values."""

    def __init__(self):
        super().__init__()
        self.raw = nn.Parameter(torch.full((2,), INIT_BIAS))

    def forward(self, x0: torch.Tensor | None = None, n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = _concentrations(self.raw)
        n = n if x0 is None else x0.shape[0]
        return a.expand(n), b.expand(n)


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


def sample(a: torch.Tensor, b: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """u ~ Beta(a, b) as the first coordinate of a Dirichlet([a, b]) draw, kept in [U_EPS, 1−U_EPS]."""
    u = torch._sample_dirichlet(torch.stack([a.detach(), b.detach()], dim=-1).float(), generator)[..., 0]
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


def bin_masses(a: torch.Tensor, b: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """P(lo ≤ u < hi) under Beta(a, b), broadcast over all arguments; the difference is taken on the
    side (CDF or survival function) where both values are small."""
    c_lo, s_lo = cdf_pair(lo, a, b)
    c_hi, s_hi = cdf_pair(hi, a, b)
    upper = lo.double() >= 0.5
    return torch.where(upper, s_lo - s_hi, c_hi - c_lo).clamp_min(0)


def timestep_edges(T: int, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The u-interval that t = round(u·(T−1)) maps to t: [(t−½)/(T−1), (t+½)/(T−1)] ∩ [0, 1]."""
    t = t.double()
    return ((t - 0.5) / (T - 1)).clamp(0, 1), ((t + 0.5) / (T - 1)).clamp(0, 1)


def timestep_probs(a: torch.Tensor, b: torch.Tensor, T: int, bins: int | None = None,
                   max_elements: int = 1 << 20) -> torch.Tensor:
    """Marginal p(t) of the Beta policies (a, b) [N] averaged over the N policies: [T] float64, or
    [bins] with bin k holding timesteps [⌊kT/bins⌋, ⌊(k+1)T/bins⌋). Chunked over the edges so that
    the series never holds more than `max_elements` values."""
    n = T if bins is None else int(bins)
    starts = torch.div(torch.arange(n + 1, device=a.device) * T, n, rounding_mode="floor")
    edges = ((starts.double() - 0.5) / (T - 1)).clamp(0, 1)  # the lower u-edge of each group's first t
    edges[-1] = 1.0
    a, b = a.reshape(-1, 1).double(), b.reshape(-1, 1).double()
    per = max(1, max_elements // (a.shape[0] * 256))
    masses = []
    for i in range(0, n, per):
        lo, hi = edges[i:min(i + per, n)], edges[i + 1:min(i + per, n) + 1]
        masses.append(bin_masses(a, b, lo[None], hi[None]).mean(0))
    return torch.cat(masses)

