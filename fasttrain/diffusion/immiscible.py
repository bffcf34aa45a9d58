"""Immiscible Diffusion (Li et al., NeurIPS 2024, arXiv 2406.12303; "Improved Immiscible Diffusion",
arXiv 2505.18521): which noise each image of a batch gets. This module only chooses; the noise options
wire the choice into the noise kernel as a per-sample noise-row map and compute the distance matrices.

  assignment(dist [B, B])  -> rows [B]   image b gets noise row rows[b]: a permutation approximately
                                         minimising Σ_b dist[b, rows[b]], on the device, no host sync
  exact_assignment(dist)   -> rows [B]   the exact minimum (SciPy, on the host): tests and benchmarks only
  knn_choice(dist [B, k])  -> j [B]      the nearest of k candidates per image (the "improved" variant)

The official code (yhli123/Immiscible-Diffusion), whose conventions callers should keep:
  * linear assignment (Linear_Assignment-stable_diffusion/conditional_*_train_sd.py): one N(0, I) draw per
    image, gathered over all ranks (the assignment is global); dist[i, j] = ||0.1·x_i - 0.1·n_j||, the L2
    distance (not squared) computed in float16 between the VAE latents (after `scaling_factor`) and the
    noise, both scaled by 0.1 to stay in fp16's range; `scipy.optimize.linear_sum_assignment` on rank 0;
    image i then gets noise n[col[i]]. Noise is only permuted within the batch, so its marginal stays
    exactly N(0, I): the objective is unchanged, only which noise pairs with which image.
  * KNN (KNN-stable_diffusion/conditional_*_train_sd.py, KNN-flow_matching/.../optimal_transport.py): k fresh
    candidates per image (k = 64 for Stable Diffusion, k = 4 for flow matching on CIFAR), dist = the fp16 L2
    distance (no 0.1 scale), the argmin is kept; per process, no communication. The chosen noise is the
    nearest of k draws, so its marginal is NOT N(0, I): it is biased toward the data (a deliberate trade-off).

The assignment here is an auction (Bertsekas 1988, "The auction algorithm: a distributed relaxation method
for the assignment problem", Ann. Oper. Res. 14; the Jacobi form, in which every unassigned image bids at
once, with ε-scaling), run for a fixed number of rounds: fixed shapes, no host sync, no data-dependent
control flow (what CUDA-graph capture needs; capture itself is not tested here, no GPU was at hand):
  1. costs double-centred (C - row mean - column mean: no permutation's total changes) and divided by their
     standard deviation, so ε is in units of the spread that the choice can exploit (a fp16, 0.1-scaled
     matrix gives the same answer as its fp32 original up to rounding); non-finite entries cost the most;
  2. `phases` phases with ε = 4^-p, p = 0..phases-1; each starts with nobody assigned and the prices of the
     last one, and runs `rounds` rounds: each unassigned image i bids for its best noise j* under the
     current prices, raising the price by (best value - second best value + ε); each noise goes to its
     highest bidder, whose predecessor becomes unassigned;
  3. whoever is still unassigned when the rounds run out (a few images at most, in the measurements) is
     completed: 8 rounds of "each free image proposes its nearest free noise, each noise takes its nearest
     proposer", then the k-th free image gets the k-th free noise. The result is always a permutation;
  4. two passes of pairwise exchange (2-opt): each image finds the other image whose noise it would swap
     with for the largest drop of their summed distance; pairs that choose each other swap.
A phase that ends with everyone assigned has a total within B·ε·s of the optimum, s the spread of step 1
(ε-complementary slackness; Bertsekas 1988, Prop. 1); the approximation is the truncation of step 2 and
the completion of step 3, which step 4 partly repairs.
Measured against the exact assignment (bench/immiscible.py → bench/results/immiscible-cpu.md, 120 batches of
images vs Gaussian noise, B = 16..256, D = 64..4096, fp16 distances; bounded in tests/diffusion/test_immiscible.py):
mean relative gap 5e-5 of the total (worst batch 5e-4); mean 0.1% (worst batch 1.7%) of what the exact assignment
gains over a random pairing is given up, about what the official code's own fp16 distances give up at D = 4096
(0.1-0.2%). `rounds` trades this for time (16: 0.3% mean, 64: 0.1%).
Cost: 4424 small ops per call with the defaults (~27 per round). On one CPU thread that is 15-90 ms against
SciPy's 0.07-12 ms, so on the CPU the exact solver is the faster one; the auction is for the GPU, where it
spares the host round trip (device → host copy, SciPy, copy back) and the stall of the launch queue. Its GPU
time (launch-bound, eager or in a CUDA graph) has not been measured yet.
"""
from __future__ import annotations

import math

import torch

PHASES, ROUNDS, FILL_ROUNDS, SWAP_PASSES, EPS_FACTOR = 5, 32, 8, 2, 4.0


def _costs(dist: torch.Tensor, square: bool) -> torch.Tensor:
    if dist.dim() != 2 or (square and dist.shape[0] != dist.shape[1]):
        raise ValueError(f"expected a {'square ' if square else ''}[B, {'B' if square else 'k'}] distance matrix, "
                         f"got shape {tuple(dist.shape)}")
    c = dist.detach().to(torch.float64 if dist.dtype == torch.float64 else torch.float32)
    finite = torch.isfinite(c)
    c = torch.where(finite, c, 0.0)
    return torch.where(finite, c, 2 * c.abs().amax() + 1)  # non-finite: dearer than every finite entry


def assignment(dist: torch.Tensor, rounds: int = ROUNDS, phases: int = PHASES) -> torch.Tensor:
    """A permutation `rows` (Long [B], on dist's device) with image b → noise rows[b], approximately minimising
    Σ_b dist[b, rows[b]] (module docstring: the auction, its fixed rounds, its measured gap). No host sync."""
    c = _costs(dist, square=True)
    B, dev = c.shape[0], c.device
    if B <= 1:
        return torch.zeros(B, dtype=torch.long, device=dev)
    c = c - c.mean(1, keepdim=True)
    c = c - c.mean(0, keepdim=True)
    a = -c / c.std(correction=0).clamp_min(torch.finfo(c.dtype).tiny)  # benefit, unit spread
    ar = torch.arange(B, device=dev)
    price = torch.zeros(B, dtype=a.dtype, device=dev)
    owner = torch.full((B,), -1, dtype=torch.long, device=dev)  # owner[j]: the image holding noise j, -1: none
    for p in range(phases):
        eps = EPS_FACTOR ** -p
        owner.fill_(-1)
        for _ in range(rounds):
            owner, price = _bid_round(a, price, owner, eps, ar)
    owner = _fill(c, owner, ar)
    rows = _pair_the_rest(owner, ar)
    for _ in range(SWAP_PASSES):
        rows = _swap_pass(c, rows, ar)
    return rows


def _holdings(owner, ar):
    """person[i]: the noise image i holds, -1: none (the inverse of `owner`; slot B takes the scatters of the
    unowned noises, so that nothing needs boolean indexing or a data-dependent shape)."""
    B = ar.numel()
    person = torch.full((B + 1,), -1, dtype=torch.long, device=ar.device)
    return person.scatter_(0, torch.where(owner >= 0, owner, B), ar)[:B]


def _bid_round(a, price, owner, eps, ar):
    """One Jacobi auction round (Bertsekas 1988, §2): every unassigned image bids at once for its best noise;
    each noise goes to its highest bidder (ties: the lowest index), whose predecessor is then unassigned
    (it no longer appears in `owner`). Returns the new owners and prices."""
    B = ar.numel()
    free = _holdings(owner, ar) < 0
    top = (a - price).topk(2, dim=1)
    v0, v1 = top.values.unbind(1)
    j = top.indices[:, 0]
    bid = torch.where(free, price[j] + (v0 - v1 + eps), -math.inf)
    best = torch.full((B,), -math.inf, dtype=a.dtype, device=a.device).scatter_reduce_(0, j, bid, "amax")
    winner = torch.full((B,), B, device=a.device).scatter_reduce_(
        0, j, torch.where(free & (bid == best[j]), ar, B), "amin")
    got = winner < B
    return torch.where(got, winner, owner), torch.where(got, best, price)


def _fill(c, owner, ar):
    """Completion, step 1: free images propose their nearest free noise; each noise takes its nearest proposer."""
    B = ar.numel()
    for _ in range(FILL_ROUNDS):
        free_i, free_j = _holdings(owner, ar) < 0, owner < 0
        val, j = torch.where(free_i[:, None] & free_j[None, :], c, math.inf).min(1)
        nearest = torch.full((B,), math.inf, dtype=c.dtype, device=c.device).scatter_reduce_(0, j, val, "amin")
        ok = free_i & torch.isfinite(val) & (val == nearest[j])
        winner = torch.full((B,), B, device=c.device).scatter_reduce_(0, j, torch.where(ok, ar, B), "amin")
        owner = torch.where(winner < B, winner, owner)
    return owner


def _pair_the_rest(owner, ar):
    """Completion, step 2: the k-th free image gets the k-th free noise. Always leaves a permutation."""
    B = ar.numel()
    person = _holdings(owner, ar)
    free_i, free_j = person < 0, owner < 0
    k_i = torch.cumsum(free_i.long(), 0) - 1
    k_j = torch.cumsum(free_j.long(), 0) - 1
    kth_free_noise = torch.zeros(B + 1, dtype=torch.long, device=ar.device).scatter_(
        0, torch.where(free_j, k_j, B), ar)
    return torch.where(free_i, kth_free_noise[k_i.clamp_min(0)], person)


def _swap_pass(c, rows, ar):
    """Step 4: gain[i, k] = (c[i, rows_i] - c[i, rows_k]) + (c[k, rows_k] - c[k, rows_i]), built as h + hᵀ so
    that it is symmetric to the bit (a + b = b + a in IEEE arithmetic; a sum in another order is not): when
    i's best partner is k and k's is i, both sides see the same gain and each takes the other's noise."""
    h = c.gather(1, rows[:, None]) - c[:, rows]  # h[i, k] = c[i, rows_i] - c[i, rows_k]
    gain = h + h.T
    gain.fill_diagonal_(0)
    best, k = gain.max(1)
    return torch.where((k[k] == ar) & (best > 0), rows[k], rows)


def exact_assignment(dist: torch.Tensor) -> torch.Tensor:
    """The exact minimum of Σ_b dist[b, rows[b]] (`scipy.optimize.linear_sum_assignment`, as the official code;
    SciPy is a dev dependency). Copies to the host: for tests and benchmarks, never for the training step."""
    from scipy.optimize import linear_sum_assignment

    c = _costs(dist, square=True)
    _, col = linear_sum_assignment(c.double().cpu().numpy())
    return torch.as_tensor(col, dtype=torch.long, device=dist.device)


def knn_choice(dist: torch.Tensor) -> torch.Tensor:
    """Per image the index of its nearest of k candidates (Long [B]): `dist` [B, k] is the L2 distance of image b
    to its own candidate j (official KNN code: k = 64 for SD, 4 for flow matching). NaN counts as farthest."""
    if dist.dim() != 2:
        raise ValueError(f"expected a [B, k] distance matrix, got shape {tuple(dist.shape)}")
    return torch.where(torch.isnan(dist), math.inf, dist).argmin(1)
