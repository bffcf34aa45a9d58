"""A 2-D Gaussian mixture whose optimal denoiser E[x0 | x_t] is known in closed form: the oracle that
tests samplers and the ELBO without training anything."""
import math

import torch

from fasttrain.diffusion import prediction as P

WEIGHTS = torch.tensor([0.3, 0.7], dtype=torch.float64)
MEANS = torch.tensor([[-1.0, 0.5], [1.0, -0.5]], dtype=torch.float64)
COVS = torch.tensor([[[0.10, 0.0], [0.0, 0.30]], [[0.20, 0.05], [0.05, 0.10]]], dtype=torch.float64)


def sample(n, generator=None):
    k = torch.multinomial(WEIGHTS, n, replacement=True, generator=generator)
    L = torch.linalg.cholesky(COVS)
    z = torch.randn(n, 2, generator=generator, dtype=torch.float64)
    return MEANS[k] + torch.einsum("nij,nj->ni", L[k], z)


def log_density(x):
    comps = [torch.distributions.MultivariateNormal(MEANS[k], COVS[k]).log_prob(x) + math.log(WEIGHTS[k])
             for k in range(len(WEIGHTS))]
    return torch.logsumexp(torch.stack(comps), 0)


def moments():
    mean = (WEIGHTS[:, None] * MEANS).sum(0)
    second = sum(WEIGHTS[k] * (COVS[k] + torch.outer(MEANS[k], MEANS[k])) for k in range(len(WEIGHTS)))
    return mean, second - torch.outer(mean, mean)


def x0_posterior_mean(x_t, a, s):
    """E[x0 | x_t] for x_t = a·x0 + s·eps (a, s: [B] float64)."""
    x_t = x_t.double()
    I = torch.eye(2, dtype=torch.float64)
    logr, cond = [], []
    for k in range(len(WEIGHTS)):
        C = a[:, None, None] ** 2 * COVS[k] + s[:, None, None] ** 2 * I  # cov of x_t under component k
        m = a[:, None] * MEANS[k]
        logr.append(torch.distributions.MultivariateNormal(m, C).log_prob(x_t) + math.log(WEIGHTS[k]))
        gain = a[:, None, None] * COVS[k] @ torch.linalg.inv(C)
        cond.append(MEANS[k] + torch.einsum("bij,bj->bi", gain, x_t - m))
    r = torch.softmax(torch.stack(logr), 0)
    return (r[..., None] * torch.stack(cond)).sum(0)


class OracleModel(torch.nn.Module):
    """Returns the exact prediction of the given type: what a perfectly trained network outputs."""

    def __init__(self, schedule, prediction):
        super().__init__()
        self.alpha, self.sigma, self.prediction = schedule.alpha, schedule.sigma, prediction

    def forward(self, x_t, t, y=None):
        a, s = self.alpha[t], self.sigma[t]
        x0 = x0_posterior_mean(x_t, a, s)
        eps = (x_t.double() - a[:, None] * x0) / s[:, None]
        return P.target(self.prediction, x0, eps, a[:, None], s[:, None]).to(x_t.dtype)
