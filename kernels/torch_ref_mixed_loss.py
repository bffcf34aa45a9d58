"""The PyTorch reference math of the mixed-prediction loss op (Xie & Agam 2025, arXiv 2502.01990: several
x0 estimates, mixed by a learned gate): the test oracle of the Triton kernel (triton_mixed_loss.py) and
of the native op, and the `torch` backend itself (mixed_loss.py).

The network predicts H heads (each a linear prediction type, see `torch_ref_diffusion_loss.py`) and a gate. Shapes:
x0, eps [B, C, *S] (S the spatial dims, possibly none); out [B, H·C + G, *S] with head i in channels
[i·C, (i+1)·C) and, for a *pixel* gate, G = H gate logits in the last H channels (one logit per head
and pixel, shared by the C channels, as lucidrains' `WeightedObjectiveGaussianDiffusion`); for a
*per-sample* gate (the timestep gate: a learned table gathered at t) G = 0 and `gate` is [B, H].

Everything per head is a row of one float32 table `tab` [H, NROWS, T], gathered at t_b:
  ce, cx   the head's target ce·eps + cx·x0 (eps (1, 0), x0 (0, 1), v (a, -s), flow (1, -1))
  k1       -s/det: head i's x0 residual is  e_i = x̂0_i - x0 = k1·(pred_i - target_i)   (exact: at
           pred = target the conversion x̂0 = (ce·x_t - s·pred)/det returns x0; prediction.py)
  fb       0, or -1 where det = 0 (x̂0_i undefined; then k1 = 0 and x̂0_i := 0, so e_i = -x0)
  bias     a fixed gate logit added to the learned one (the conditioning prior; -1e9 masks a head)
  aux      the weight of the head's own-space MSE (aux_weight; lucidrains uses 0.1)
so the kernels need no per-type code and never divide (the host builds the table,
fasttrain/diffusion/mixed.py, in float64).

Per sample b, with d_i = pred_i - target_i (own space), e_i = k1_i·d_i + fb_i·x0, π = softmax over
heads of (gate + bias) (per pixel, broadcast over channels) and E = Σ_i π_i·e_i = x̂0_mix - x0:
  raw_b        mean(E²)                                   the mixed estimate's x0-space MSE
  weighted_b   w[t_b]·raw_b + Σ_i aux_i[t_b]·mean(d_i²)   the sample's objective (w: an x0-space weight)
  per_sample   ℓ_b = iw_b·weighted_b;  loss = mean_b ℓ_b
  x0_error     [B, H]: mean(e_i²), each head's own x0-space MSE (what mode=argmin ranks)
Gradients of L = mean_b ℓ_b (written in the forward pass by the fused backends), with s_b = 2·iw_b/(B·D):
  ∂L/∂pred_i = s_b·(w·π_i·k1_i·E + aux_i·d_i)
  ∂L/∂gate_i = s_b·w·Σ_c π_i·(e_i - E)·E          (softmax Jacobian; summed over channels; for the
                                                   per-sample gate also over pixels)
With a loss shape ρ (loss_shape.py: Huber family, l1; threshold c = c_table[t_b]) every squared residual of
the objective becomes ρ: raw_b = mean(ρ(E)) (the mixed x0-space term), the aux terms mean(ρ(d_i)); and E,
d_i in the gradients become ψ(E), ψ(d_i) (ψ = ρ'/2). x0_error stays each head's x0-space MSE (a statistic
that ranks the heads, mode=argmin).
"""
from __future__ import annotations

import torch

from . import loss_shape

ROWS = ("ce", "cx", "k1", "fb", "bias", "aux")
CE, CX, K1, FB, BIAS, AUX = range(len(ROWS))
NROWS = len(ROWS)
MASKED = -1e9  # bias of a head whose x̂0 is undefined at t: softmax weight exactly 0 in fp32


def check_shapes(out: torch.Tensor, x0: torch.Tensor, tab: torch.Tensor, gate: torch.Tensor | None) -> tuple[int, int]:
    """(H, C); a one-line error when out/gate/tab do not fit x0."""
    if tab.ndim != 3 or tab.shape[1] != NROWS or tab.shape[0] < 2:
        raise ValueError(f"the mixed head table must be [H >= 2, {NROWS}, T], got {tuple(tab.shape)}")
    H, C = tab.shape[0], x0.shape[1]
    width = H * C + (0 if gate is not None else H)
    if out.shape[0] != x0.shape[0] or out.shape[1] != width or out.shape[2:] != x0.shape[2:]:
        kind = "per-sample gate" if gate is not None else "pixel gate"
        raise ValueError(f"mixed output must be [B, {width}, *S] for {H} heads × {C} channels with a {kind}, "
                         f"got {tuple(out.shape)} for data {tuple(x0.shape)}")
    if gate is not None and tuple(gate.shape) != (x0.shape[0], H):
        raise ValueError(f"the per-sample gate must be [B, H] = {(x0.shape[0], H)}, got {tuple(gate.shape)}")
    return H, C


def split(out: torch.Tensor, H: int, C: int, pixel_gate: bool):
    """(heads [B, H, C, *S], pixel gate logits [B, H, *S] or None): views of the network output."""
    B, S = out.shape[0], out.shape[2:]
    heads = out[:, : H * C].reshape(B, H, C, *S)
    return heads, (out[:, H * C:] if pixel_gate else None)


def rows(tab: torch.Tensor, t: torch.Tensor, ndim: int) -> list[torch.Tensor]:
    """Every row of the table at t, as float32 [B, H, 1, ...] broadcasting over [B, H, C, *S]."""
    g = tab.to(torch.float32)[:, :, t].permute(2, 0, 1)  # [B, H, NROWS]
    return [g[:, :, r].reshape(g.shape[0], g.shape[1], *([1] * (ndim - 1))) for r in range(NROWS)]


def parts(out, x0, eps, t, tab, gate=None):
    """(d, e, E, π, aux): own-space residuals d [B, H, C, *S], x0 residuals e, the mixed residual
    E [B, C, *S], the gate weights π [B, H, 1, *S] and the aux weights [B, H, 1, ...], in fp32."""
    H, C = check_shapes(out, x0, tab, gate)
    heads, g = split(out, H, C, gate is None)
    ce, cx, k1, fb, bias, aux = rows(tab, t, x0.ndim)
    x0f, ef = x0.float()[:, None], eps.float()[:, None]
    d = heads.float() - (ce * ef + cx * x0f)
    e = k1 * d + fb * x0f
    logits = g.float().unsqueeze(2) if g is not None else gate.float().reshape(bias.shape)
    pi = torch.softmax(logits + bias, dim=1)
    return d, e, (pi * e).sum(1), pi, aux


def thresholds(c_table, t, ndim: int, kind: int):
    """c(t_b) shaped to broadcast over E [B, C, *S] and over d [B, H, C, *S] (None without a threshold)."""
    if not loss_shape.needs_c(kind):
        return None, None
    c = c_table.to(torch.float32)[t].view(-1, *([1] * (ndim - 1)))
    return c, c[:, None]


def loss(out, x0, eps, t, weight, iw, tab, gate=None, kind: int = loss_shape.L2, c_table=None):
    """(ℓ [B], raw [B], weighted [B], x0_error [B, H]): differentiable in out and gate (autograd: the
    independent check of the gradients the kernel writes)."""
    d, e, E, _, aux = parts(out, x0, eps, t, tab, gate)
    cE, cd = thresholds(c_table, t, x0.ndim, kind)
    raw = loss_shape.rho(E, cE, kind).flatten(1).mean(1)
    own = loss_shape.rho(d, cd, kind).flatten(2).mean(2)
    weighted = weight.to(torch.float32)[t] * raw + (aux.flatten(1) * own).sum(1)
    return iw.float() * weighted, raw, weighted, e.pow(2).flatten(2).mean(2)


def loss_and_grad(out, x0, eps, t, weight, iw, tab, gate=None, kind: int = loss_shape.L2, c_table=None):
    """`loss` (detached) plus the closed-form ∂(mean_b ℓ_b)/∂out [out's dtype] and ∂/∂gate ([B, H] in
    gate's dtype; empty for a pixel gate, whose gradient is in the last H channels of the first)."""
    with torch.no_grad():
        d, e, E, pi, aux = parts(out, x0, eps, t, tab, gate)
        B, H, C = out.shape[0], tab.shape[0], x0.shape[1]
        D = x0[0].numel()
        ones = [1] * (x0.ndim - 1)
        s = (2.0 / (B * D)) * iw.float()
        w = weight.to(torch.float32)[t] * s
        k1 = rows(tab, t, x0.ndim)[K1]
        cE, cd = thresholds(c_table, t, x0.ndim, kind)
        gE = w.view(B, *ones) * loss_shape.psi(E, cE, kind)  # ∂L/∂E
        g_heads = pi * k1 * gE[:, None] + aux * s.view(B, 1, *ones) * loss_shape.psi(d, cd, kind)
        g_gate = (pi * (e - E[:, None]) * gE[:, None]).sum(2)  # [B, H, *S]
        raw = loss_shape.rho(E, cE, kind).flatten(1).mean(1)
        own = loss_shape.rho(d, cd, kind).flatten(2).mean(2)
        weighted = weight.to(torch.float32)[t] * raw + (aux.flatten(1) * own).sum(1)
        x0err = e.pow(2).flatten(2).mean(2)
        g_heads = g_heads.reshape(B, H * C, *x0.shape[2:])
        if gate is None:
            grad_out, grad_gate = torch.cat([g_heads, g_gate], 1), out.new_empty(0)
        else:
            grad_out, grad_gate = g_heads, g_gate.reshape(B, H, -1).sum(2).to(gate.dtype)
        return iw.float() * weighted, raw, weighted, x0err, grad_out.to(out.dtype), grad_gate
