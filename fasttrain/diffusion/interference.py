"""Cross-timestep interference (Xie & Agam 2025, arXiv 2502.01990): how much an update driven by the
timesteps of one bucket changes the loss of every other bucket, measured every K steps on a fixed
probe batch. A `LookAhead` (lookahead.py), called after the optimizer step with gradients cleared.

Probe: P images of the first batch it sees (kept), each at one fixed timestep per bucket (the midpoints
of P strata of the bucket: variation.bucket_timesteps) with fixed noise, so every measurement sees
the same (x0, t, ε) and two measurements differ only by the model (common random numbers).

Measurement at θ (the weights after this step): the training objective's per-sample loss ℓ (its
weighting, prediction type and learned weighting: `objective.probe_loss`) averaged per bucket, L_j(θ);
for each bucket i its gradient g_i = ∇θ L_i (one backward), an update of the size an Adam step has
(‖Δθ‖ = lr·√n for n parameters, since Adam moves each coordinate by about lr) along −g_i,
the losses again, and the weights restored:

    M[i, j] = L_j(θ − lr·√n · g_i/‖g_i‖) − L_j(θ)

The diagonal is negative (a bucket's own step lowers its loss); M[i, j] > 0 off the diagonal means an
update driven by bucket i undoes progress in bucket j: the paper's interference. Also logged: the
coefficient of variation of ‖g_i‖ across buckets (variation.py). Across ranks each rank probes its
own batch; gradients are averaged by the data-parallel wrapper, losses by one all-reduce.
Cost: B backward + (B + 1) probe forwards of B·P samples every `every` steps.
"""
from __future__ import annotations

import math
import time

import torch

from fasttrain.kernels import philox

from .lookahead import LookAhead, LookAheadContext, all_reduce_sum_
from .variation import bucket_timesteps, coefficient_of_variation


class InterferenceDiagnostic(LookAhead):
    def __init__(self, T: int, every: int = 500, n_buckets: int = 4, probe_size: int = 16, seed: int = 0):
        if every < 1 or n_buckets < 2 or probe_size < 1:
            raise ValueError("interference needs every >= 1, n_buckets >= 2 and probe_size >= 1")
        self.T, self.every, self.n_buckets, self.probe_size, self.seed = T, every, n_buckets, probe_size, seed
        self.probe = None
        self.history: list[dict] = []  # {"step", "matrix" [B, B], "grad_norms" [B], "losses" [B]}
        self.seconds = 0.0

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def _build_probe(self, ctx: LookAheadContext):
        P = min(self.probe_size, ctx.x0.shape[0])
        x0 = ctx.x0[:P].detach().clone()
        labels = None if ctx.labels is None else ctx.labels[:P].clone()
        ts = bucket_timesteps(self.T, self.n_buckets, P, x0.device)  # [B, P]
        reps = (self.n_buckets,) + (1,) * (x0.ndim - 1)
        x = x0.repeat(reps)
        self.probe = {"x0": x, "t": ts.reshape(-1), "eps": philox.noise(x.shape, self.seed, 0, x.device),
                      "labels": None if labels is None else labels.repeat(self.n_buckets), "P": P}

    def _bucket_losses(self, ctx, grad_bucket: int | None = None) -> torch.Tensor:
        """Per-bucket mean loss [B] (and, for `grad_bucket`, that bucket's backward into .grad)."""
        p = self.probe
        if grad_bucket is not None:
            sl = slice(grad_bucket * p["P"], (grad_bucket + 1) * p["P"])
            lab = None if p["labels"] is None else p["labels"][sl]
            ctx.objective.probe_loss(ctx.model, p["x0"][sl], p["t"][sl], p["eps"][sl], lab).mean().backward()
            return None
        with torch.no_grad():
            per = ctx.objective.probe_loss(ctx.model, p["x0"], p["t"], p["eps"], p["labels"]).float()
        losses = per.view(self.n_buckets, p["P"]).mean(1)
        return all_reduce_sum_(losses, ctx.world_size) / max(ctx.world_size, 1)

    def after_update(self, ctx: LookAheadContext) -> None:
        t0 = time.perf_counter()
        if self.probe is None:
            self._build_probe(ctx)
        model = ctx.model
        params = [q for q in model.parameters() if q.requires_grad]
        n = sum(q.numel() for q in params)  # local shards under FSDP: sizes sum to the model's over ranks
        n = all_reduce_sum_(torch.tensor(float(n)), ctx.world_size).item() if ctx.world_size > 1 else n
        lr = float(ctx.lr) if getattr(ctx, "lr", None) is not None else 1e-3
        step = lr * math.sqrt(n)
        saved = [q.detach().clone() for q in params]
        base = self._bucket_losses(ctx)
        rows, norms = [], []
        for i in range(self.n_buckets):
            for q in params:
                q.grad = None
            self._bucket_losses(ctx, grad_bucket=i)
            grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
            sq = sum((g.detach().float() ** 2).sum() for g in grads)
            if hasattr(sq, "full_tensor"):
                sq = sq.full_tensor()
            norm = sq.sqrt()
            norms.append(norm)
            with torch.no_grad():  # θ − lr·√n·g_i/‖g_i‖ (params equal `saved` here)
                torch._foreach_add_(params, [g.detach().to(q.dtype) for g, q in zip(grads, params)],
                                    alpha=-step / max(float(norm), 1e-30))
            rows.append(self._bucket_losses(ctx) - base)
            with torch.no_grad():
                torch._foreach_copy_(params, saved)
        for q in params:
            q.grad = None
        norms = torch.stack(norms).double()
        self.history.append({"step": ctx.step + 1, "matrix": torch.stack(rows).cpu(), "grad_norms": norms.cpu(),
                             "losses": base.cpu()})
        self.seconds += time.perf_counter() - t0

    def metrics(self) -> dict:
        if not self.history:
            return {}
        last = self.history[-1]
        m = last["matrix"]
        off = m[~torch.eye(self.n_buckets, dtype=torch.bool)]
        return {"interference_offdiag_mean": float(off.mean()), "interference_diag_mean": float(m.diagonal().mean()),
                "grad_norm_cv": float(coefficient_of_variation(last["grad_norms"])),
                "interference_seconds": self.seconds}

    def state_dict(self) -> dict:
        return {"history": self.history, "probe": self.probe, "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.history, self.probe, self.seconds = list(state["history"]), state["probe"], float(state["seconds"])
