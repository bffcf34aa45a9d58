"""Cross-timestep interference (Xie & Agam 2025, arXiv 2502.01990): how much an update driven by the
timesteps of one bucket changes the loss of every other bucket, measured every K steps on a fixed
probe batch. A `LookAhead` (lookahead.py), called after the optimizer step with gradients cleared.

Probe: P images of the first batch it sees (kept), each at one fixed timestep per bucket (the midpoints
of P strata of the bucket: variation.bucket_timesteps) with fixed noise, so every measurement sees
the same (x0, t, ε) and two measurements differ only by the model (common random numbers).

Measurement, right after the optimizer step, at the new weights θ: the training objective's
per-sample loss ℓ (its weighting, prediction type and learned weighting: `objective.probe_loss`),
per bucket L_j, and its gradient g_j = ∇θ L_j (one backward per bucket). The update that bucket i
alone would drive is the optimizer's step from g_i: Δθ_i = −lr·P·g_i, with P = 1/(sqrt(v̂) + ε) from
the run's own Adam second moments (Kingma & Ba 2015, Alg. 1; without momentum; P = 1 for an
optimizer without them). Its effect on bucket j, to first order in the step:

    M[i, j] = ∇L_j · Δθ_i = −lr · g_jᵀ P g_i

The diagonal is negative (a bucket's own step lowers its loss); M[i, j] > 0 off the diagonal means an
update driven by bucket i raises bucket j's loss, undoing its progress: the paper's interference. The
normalised form C[i, j] = g_iᵀPg_j / (‖g_i‖_P ‖g_j‖_P) (the gradients' cosine in the optimizer's
metric) is recorded too. First order, because a finite step of Adam's size along one bucket's noisy
gradient overshoots (its per-coordinate size is that of the momentum-averaged step, not of one
gradient), and the sign of an overshoot says nothing about interference.
Also logged: the coefficient of variation of ‖g_i‖ across buckets (variation.py). Across ranks each
rank probes its own batch; gradients are averaged by the data-parallel wrapper, so M is the global
probe's. Cost: B backward passes of P probe samples every `every` steps.
"""
from __future__ import annotations

import time

import torch

from fasttrain.kernels import philox

from ..errors import InvalidInput
from .lookahead import LookAhead, LookAheadContext, all_reduce_sum_
from .variation import bucket_timesteps, coefficient_of_variation


def _dot(a: list, b: list) -> torch.Tensor:
    """Σ a·b over lists of (possibly FSDP-sharded DTensor) tensors, as a float64 0-d CPU tensor."""
    s = sum((x.double() * y.double()).sum() for x, y in zip(a, b))
    if hasattr(s, "full_tensor"):  # a partial sum over shards: the all-reduce gives the whole
        s = s.full_tensor()
    return s.detach().cpu()


class InterferenceDiagnostic(LookAhead):
    acts_before = False  # it measures after the update only

    def __init__(self, T: int, every: int = 500, n_buckets: int = 4, probe_size: int = 16, seed: int = 0):
        if every < 1 or n_buckets < 2 or probe_size < 1:
            raise InvalidInput("interference needs every >= 1, n_buckets >= 2 and probe_size >= 1")
        self.T, self.every, self.n_buckets, self.probe_size, self.seed = T, every, n_buckets, probe_size, seed
        self.probe = None
        self.history: list[dict] = []  # {"step", "matrix" [B, B], "grad_norms" [B], "losses" [B]}
        self.seconds = 0.0  # since the last `metrics()`

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def _build_probe(self, ctx: LookAheadContext):
        P = min(self.probe_size, ctx.x0.shape[0])
        x0 = ctx.x0[:P].detach().clone()
        labels = None if ctx.labels is None else ctx.labels[:P].clone()
        ts = bucket_timesteps(self.T, self.n_buckets, P, x0.device)  # [B, P]
        reps = (self.n_buckets,) + (1,) * (x0.ndim - 1)
        x = x0.repeat(reps)
        self.probe = {"x0": x, "t": ts.reshape(-1), "eps": philox.randn(x.shape, self.seed, 0, x.device),
                      "labels": None if labels is None else labels.repeat(self.n_buckets), "P": P}

    def _bucket_grad(self, ctx, i: int) -> torch.Tensor:
        """Backward of bucket i's mean probe loss into .grad; returns the loss (detached)."""
        if self.probe["x0"].device != ctx.x0.device:  # restored from a checkpoint (host tensors)
            self.probe = {k: (v.to(ctx.x0.device) if isinstance(v, torch.Tensor) else v) for k, v in self.probe.items()}
        p = self.probe
        sl = slice(i * p["P"], (i + 1) * p["P"])
        lab = None if p["labels"] is None else p["labels"][sl]
        loss = ctx.objective.probe_loss(ctx.model, p["x0"][sl], p["t"][sl], p["eps"][sl], lab).mean()
        loss.backward()
        return loss.detach().float()

    @staticmethod
    def _preconditioner(opt, params) -> list:
        """1/(sqrt(v̂) + ε) per parameter from an Adam-type optimizer's state (None where absent)."""
        out = []
        for q in params:
            st = opt.state.get(q, {}) if opt is not None else {}
            if "exp_avg_sq" not in st:
                out.append(None)
                continue
            group = next(g for g in opt.param_groups if any(q is x for x in g["params"]))
            k = float(st["step"]) if "step" in st else 1.0
            v_hat = st["exp_avg_sq"] / (1 - group["betas"][1] ** max(k, 1.0))
            out.append(1.0 / (v_hat.sqrt() + group["eps"]))
        return out

    def after_update(self, ctx: LookAheadContext) -> None:
        t0 = time.perf_counter()
        if self.probe is None:
            self._build_probe(ctx)
        params = [q for q in ctx.model.parameters() if q.requires_grad]
        precond = self._preconditioner(ctx.optimizer, params)
        lr = float(ctx.lr) if ctx.lr is not None else 1e-3
        grads, losses = [], []
        for i in range(self.n_buckets):
            for q in params:
                q.grad = None
            losses.append(self._bucket_grad(ctx, i))
            grads.append([torch.zeros_like(q) if q.grad is None else q.grad.detach().clone() for q in params])
        for q in params:
            q.grad = None
        B = self.n_buckets
        gram = torch.zeros(B, B, dtype=torch.float64)  # g_iᵀ P g_j
        for i in range(B):
            pg = [g if c is None else g * c for g, c in zip(grads[i], precond)]
            for j in range(i, B):
                gram[i, j] = gram[j, i] = float(_dot(pg, grads[j]))
        d = gram.diagonal().clamp_min(1e-300).sqrt()
        norms = torch.stack([_dot(g, g).sqrt() for g in grads]).double().cpu()
        losses = all_reduce_sum_(torch.stack(losses), ctx.world_size) / max(ctx.world_size, 1)
        self.history.append({"step": ctx.step + 1, "matrix": -lr * gram, "cosine": gram / (d[:, None] * d[None, :]),
                             "grad_norms": norms, "losses": losses.double().cpu()})
        self.seconds += time.perf_counter() - t0

    def metrics(self) -> dict:
        if not self.history:
            return {}
        last = self.history[-1]
        m = last["matrix"]
        off = m[~torch.eye(self.n_buckets, dtype=torch.bool)]
        seconds, self.seconds = self.seconds, 0.0
        cos = last["cosine"][~torch.eye(self.n_buckets, dtype=torch.bool)]
        return {"interference/offdiag_mean": float(off.mean()), "interference/diag_mean": float(m.diagonal().mean()),
                "interference/cosine_offdiag_mean": float(cos.mean()),
                "interference/grad_norm_cv": float(coefficient_of_variation(last["grad_norms"])),
                "interference/lookahead_s": seconds}

    def state_dict(self) -> dict:
        probe = None if self.probe is None else {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                                 for k, v in self.probe.items()}
        return {"history": self.history, "probe": probe}

    def load_state_dict(self, state: dict) -> None:
        """The probe comes back as host tensors and moves to the model's device when first used."""
        self.history = list(state["history"])
        self.probe = None if state["probe"] is None else dict(state["probe"])
