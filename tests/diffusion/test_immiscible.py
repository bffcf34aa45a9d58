"""Immiscible Diffusion's assignment: the device auction against SciPy's exact assignment on image-vs-noise
distances as the official code computes them, its permutation guarantee on hostile inputs, no host sync
(meta tensors cannot be read back), the exact solver against brute force, and the KNN choice."""
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fasttrain.diffusion.immiscible import assignment, exact_assignment, knn_choice

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from immiscible import images  # the benchmark's image batches: digits, latent-like fields


def official_dist(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """||0.1·x_i - 0.1·n_j||: L2, not squared, 0.1-scaled, in float16 (Linear_Assignment-stable_diffusion);
    computed in fp32 and rounded to fp16 (the source's [B, B, D] fp16 broadcast does not fit a CPU test)."""
    return torch.cdist(0.1 * x, 0.1 * n, compute_mode="donot_use_mm_for_euclid_dist").half()


def total(d: torch.Tensor, rows: torch.Tensor) -> float:
    return d.double()[torch.arange(d.shape[0]), rows].sum().item()


def is_permutation(rows: torch.Tensor, B: int) -> bool:
    return rows.dtype == torch.long and rows.shape == (B,) and torch.equal(rows.sort().values, torch.arange(B))


SIZES = [(16, 64), (32, 4096), (64, 1024), (128, 256), (256, 64), (256, 4096)]


def test_optimality_gap_against_the_exact_assignment():
    """Mean relative gap (ours - exact)/exact <= 1e-3 over realistic batches (measured: ~1e-4; the issue asked
    for <= 1%), and <= 1% of what the exact assignment gains over a random pairing (measured ~0.1%): the
    second bound has teeth, since a random pairing's own relative gap is ~2-10% here."""
    g = torch.Generator().manual_seed(0)
    rel, lost, rand_rel = [], [], []
    for (B, D), kind in itertools.product(SIZES, ["digits", "latent"]):
        d = official_dist(images(kind, B, D, g), torch.randn(B, D, generator=g))
        rows = assignment(d)
        assert is_permutation(rows, B)
        ours, best = total(d, rows), total(d, exact_assignment(d))
        rand = np.mean([total(d, torch.randperm(B, generator=g)) for _ in range(8)])
        assert ours >= best - 1e-9 * best
        rel.append((ours - best) / best)
        lost.append((ours - best) / (rand - best))
        rand_rel.append((rand - best) / best)
    assert np.mean(rel) <= 1e-3 and np.mean(lost) <= 0.01 and max(lost) <= 0.05, (np.mean(rel), np.mean(lost))
    assert np.mean(rand_rel) > 0.01


def test_a_clear_optimum_is_found_and_the_convention_is_image_to_noise_row():
    g = torch.Generator().manual_seed(1)
    B = 40
    perm = torch.randperm(B, generator=g)
    d = torch.rand(B, B, generator=g) + 5.0
    d[torch.arange(B), perm] = torch.rand(B, generator=g)  # image b's nearest noise is perm[b], by far
    assert torch.equal(assignment(d), perm) and torch.equal(exact_assignment(d), perm)


@pytest.mark.parametrize("case", ["equal", "ties", "nan_inf", "huge", "negative", "fp16", "fp64", "no_rounds"])
@pytest.mark.parametrize("B", [1, 2, 3, 17, 64])
def test_always_a_permutation(case, B):
    g = torch.Generator().manual_seed(B)
    d = torch.rand(B, B, generator=g)
    kw = {}
    if case == "equal":
        d = torch.full((B, B), 3.0)
    elif case == "ties":
        d = torch.randint(0, 3, (B, B), generator=g).float()
    elif case == "nan_inf":
        d[d < 0.2], d[d > 0.9] = float("nan"), float("inf")
        d[0, :] = float("-inf")
    elif case == "huge":
        d = d * 1e30
    elif case == "negative":
        d = -10 * d
    elif case in ("fp16", "fp64"):
        d = d.to(torch.float16 if case == "fp16" else torch.float64)
    else:
        kw = {"rounds": 0, "phases": 0}
    assert is_permutation(assignment(d, **kw), B)


def test_a_permutation_with_repeated_images():
    """A batch that holds an image twice (small data sets, oversampling) has equal rows, so exchange gains of
    exactly 0 that a sum in another order rounds to ±1 ulp: an exchange seen from one side only once broke
    the permutation (see `_swap_pass`). fp16 distances tie often too; few rounds leave more to steps 3-4."""
    g = torch.Generator().manual_seed(4)
    for i in range(9):
        B = int(torch.randint(16, 257, (), generator=g))
        x = images("digits", B, 64, g)
        x[B // 2:] = x[torch.randint(0, B // 2, (B - B // 2,), generator=g)]
        d = official_dist(x, torch.randn(B, 64, generator=g))
        assert is_permutation(assignment(d, rounds=(2, 8, 32)[i % 3], phases=3), B)


def test_no_host_sync():
    """Meta tensors have no data: any read-back (item, bool, nonzero, boolean indexing, numpy) raises. (Few
    rounds: every round runs the same code, and meta dispatch is slow.)"""
    rows = assignment(torch.empty(33, 33, device="meta", dtype=torch.float16), rounds=2, phases=2)
    assert rows.device.type == "meta" and rows.shape == (33,) and rows.dtype == torch.long
    assert knn_choice(torch.empty(33, 64, device="meta")).shape == (33,)


def test_exact_assignment_is_exact():
    g = torch.Generator().manual_seed(2)
    d = torch.rand(6, 6, generator=g, dtype=torch.float64)
    brute = min(itertools.permutations(range(6)), key=lambda p: sum(d[i, p[i]].item() for i in range(6)))
    assert exact_assignment(d).tolist() == list(brute)


def test_knn_choice_is_the_official_argmin_and_biases_the_noise():
    g = torch.Generator().manual_seed(3)
    B, k, D = 512, 4, 64  # flow matching's k
    x = images("digits", B, D, g)
    cand = torch.randn(B, k, D, generator=g)
    dist = torch.linalg.vector_norm(x.half()[:, None] - cand.half(), dim=2)  # KNN-*: fp16 L2, no 0.1 scale
    j = knn_choice(dist)
    assert torch.equal(j, torch.min(dist, dim=1)[1])
    chosen = cand[torch.arange(B), j]
    # nearest-of-k noise leans toward its image: E[<n, x>] > 0 (a N(0, I) draw independent of x has mean 0)
    corr = (chosen * x).sum(1) / x.norm(dim=1)
    assert corr.mean() > 5 * corr.std() / B**0.5
    dist[0, j[0]] = float("nan")
    assert knn_choice(dist)[0] != j[0]  # NaN counts as farthest


def test_shape_errors():
    with pytest.raises(ValueError, match=r"square \[B, B\] distance matrix, got shape \(3, 4\)"):
        assignment(torch.rand(3, 4))
    with pytest.raises(ValueError, match=r"\[B, k\] distance matrix, got shape \(3,\)"):
        knn_choice(torch.rand(3))


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    d = torch.rand(256, 256, device="cuda").half()
    assignment(d)  # warm-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = assignment(d)
        j = knn_choice(d[:, :64])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert is_permutation(rows.cpu(), 256) and j.shape == (256,)
    best = total(d.cpu(), exact_assignment(d).cpu())
    assert total(d.cpu(), rows.cpu()) <= best * (1 + 1e-2)
