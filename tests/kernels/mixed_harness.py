"""The harness of the mixed-prediction loss tests (test_mixed_loss.py): one backend of the op against
the PyTorch reference math (torch_ref_mixed_loss.py) and autograd of it, on the same inputs, head sets,
weightings and bins."""
import torch
from harness import TOL

from fasttrain import diffusion as fd
from fasttrain.diffusion import mixed as M
from fasttrain.kernels import TimestepBins, philox
from fasttrain.kernels import torch_ref_mixed_loss as mixed_ref
from fasttrain.kernels.mixed_loss import mixed_loss

T = 1000
VP_SETS = [("eps", "x0"), ("eps", "v"), ("x0", "v"), ("eps", "x0", "v")]
FLOW_SETS = [("eps", "flow"), ("flow", "x0", "v", "eps")]
CASES = [(h, g) for h in VP_SETS + FLOW_SETS for g in ("pixel", "timestep")]
WEIGHTINGS = ["min_snr", "constant", "edm", "snr"]
NOISE_TOL = dict(rtol=1e-4, atol=1e-5)  # eps drawn in the op: log/cos rounding (fastmath.h, tl.randn)


def setup(heads, weighting="min_snr", aux=0.3, device="cpu"):
    """The x0-space weight table [T] and the head table for `heads` (flow sets on the flow schedule,
    the others on a zero-terminal-SNR linear schedule, where the eps head is masked at T-1)."""
    s = fd.schedule("flow", T=T) if "flow" in heads else fd.schedule("linear", T=T, zero_terminal_snr=True)
    return fd.loss_weight(weighting, s, "x0").float().to(device), M.head_table(heads, s, aux_weight=aux).to(device)


def inputs(shape, H, pixel, dtype=torch.float32, seed=0, device="cpu"):
    """x0, eps, t, importance weights, the network output [B, H·C (+ H gate channels), *S] and the
    per-sample gate logits (None for the pixel gate); half of the batch on one timestep, the last
    sample on T-1."""
    g = torch.Generator().manual_seed(seed)
    B, C, S = shape[0], shape[1], shape[2:]
    x0 = (torch.rand(shape, generator=g) * 2 - 1).to(dtype)
    eps = torch.randn(shape, generator=g)
    t = torch.randint(0, T, (B,), generator=g)
    t[: (B + 1) // 2] = 7  # several samples on one timestep
    t[-1] = T - 1  # zero-terminal SNR / the last flow step: the eps head is masked there
    iw = torch.rand(B, generator=g) + 0.5
    out = torch.randn(B, H * C + (H if pixel else 0), *S, generator=g)
    if pixel:
        out[:, H * C:] *= 2  # gate logits of a few units
    gate = None if pixel else (2 * torch.randn(B, H, generator=g)).to(dtype).to(device)
    return x0.to(device), eps.to(device), t.to(device), iw.to(device), out.to(dtype).to(device), gate


def filled_bins(V, seed=3, device="cpu"):
    """Bins that already hold values (the scatter accumulates) and non-zero pivots."""
    g = torch.Generator().manual_seed(seed)
    b = TimestepBins(T, V, device)
    b.data = torch.randn(1 + 2 * V, T, dtype=torch.float64, generator=g).to(device)
    b.pivots = (torch.randn(V, T, dtype=torch.float64, generator=g) * 0.1).to(device)
    return b


def leaf(x):
    return None if x is None else x.detach().clone().requires_grad_()


def close(a, b, tol):
    """Gradients (of order 1/(B·D)): the absolute tolerance relative to the largest one."""
    torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * b.abs().max().item())


def run_and_compare(backend, heads, pixel, shape, weighting="min_snr", dtype=torch.float32, *, device="cpu",
                    op_noise=False, block=0):
    """One call of `backend` with pre-filled bins against the reference under autograd: the loss and its
    per-sample parts, the gradients written in the forward pass (outputs and gate), and the scatter into
    the bins (raw, weighted and each head's x0 error). `op_noise`: eps drawn in the op from Philox."""
    w, tab = setup(heads, weighting, device=device)
    H = len(heads)
    x0, eps, t, iw, out, gate = inputs(shape, H, pixel, dtype, device=device)
    bins = filled_bins(2 + H, device=device)
    before = bins.data.clone()
    o, g = leaf(out), leaf(gate)
    kw = dict(seed=11, offset=4321) if op_noise else dict(eps=eps)
    res = mixed_loss(o, x0, t, w, iw, tab, gate=g, bins=bins, backend=backend, block=block, **kw)
    res.loss.backward()
    if op_noise:
        eps = philox.randn(x0.shape, 11, 4321, device)
    ro, rg = leaf(out), leaf(gate)
    per, raw, wl, x0e = mixed_ref.loss(ro, x0, eps, t, w, iw, tab, rg)
    per.mean().backward()
    tol = NOISE_TOL if op_noise else TOL[torch.float32]
    for got, want in [(res.per_sample, per), (res.raw, raw), (res.weighted, wl), (res.x0_error, x0e),
                      (res.loss, per.mean())]:
        torch.testing.assert_close(got, want.detach(), **tol)
    grad_tol = TOL[dtype] if dtype != torch.float32 else tol
    assert o.grad.dtype == dtype
    close(o.grad, ro.grad.to(dtype), grad_tol)
    if gate is not None:
        assert g.grad.dtype == dtype
        close(g.grad, rg.grad.to(dtype), grad_tol)
    expect = TimestepBins(T, 2 + H, device)
    expect.pivots = bins.pivots
    expect.scatter_(t, torch.cat([raw[None], wl[None], x0e.T]).detach())
    torch.testing.assert_close(bins.data, before + expect.data, rtol=1e-4, atol=1e-7)
    return res
