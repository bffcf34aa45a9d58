"""The native C++ mixed-prediction loss (fasttrain_C::mixed_loss) against the PyTorch reference on the
CPU, forward + backward, on one latent batch:

    python bench/mixed_native.py          # writes bench/results/mixed-native-cpu.{md,json}

Batch 256×4×32×32 (fp32 x0), heads (eps, x0, v) in a bf16 network output, pixel gate (3·4 + 3
channels) and timestep gate ([B, 3] logits); x0-space min-SNR weight, bins of 2 + 3 values.
Implementations:
  reference  mixed_reference.loss under autograd, eps from torch's generator, the bins scattered
             afterwards: what a trainer without fused kernels does
  torch      ops_mixed backend "torch": the closed-form gradients (mixed_reference.loss_and_grad), with
             the same explicit eps (its in-op Philox stream in plain PyTorch is a test tool, far slower)
  native     ops_mixed backend "native": eps regenerated from the Philox stream inside the op
Interleaved rounds (every implementation once per round, rotating order, so that load from other
processes hits them alike); ratios are of the medians. FASTTRAIN_BENCH_THREADS threads (default 2).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cases import machine  # noqa: E402

from fasttrain import diffusion as fd  # noqa: E402
from fasttrain.diffusion import mixed as M  # noqa: E402
from fasttrain.kernels import TimestepBins, mixed_reference as mref, native, ops_mixed  # noqa: E402

SHAPE, HEADS, T, ROUNDS = (256, 4, 32, 32), ("eps", "x0", "v"), 1000, 21
RESULTS = Path(__file__).parent / "results"


class Case:
    def __init__(self, gate: str, seed: int = 0):
        s = fd.schedule("linear", T=T)
        self.w = fd.loss_weight("min_snr", s, "x0").float()
        self.tab = M.head_table(HEADS, s)
        g = torch.Generator().manual_seed(seed)
        B, C, H = SHAPE[0], SHAPE[1], len(HEADS)
        self.x0 = torch.rand(SHAPE, generator=g) * 2 - 1
        self.t = torch.randint(0, T, (B,), generator=g)
        self.iw = torch.ones(B)
        width = H * C + (H if gate == "pixel" else 0)
        self.out = (torch.randn(B, width, *SHAPE[2:], generator=g) * 0.5).bfloat16().requires_grad_()
        self.gate = (torch.randn(B, H, generator=g)).requires_grad_() if gate == "timestep" else None
        self.eps = torch.randn(SHAPE, generator=g)
        self.bins = TimestepBins(T, 2 + H)

    def _zero(self):
        self.out.grad = None
        if self.gate is not None:
            self.gate.grad = None

    def reference(self):
        self._zero()
        eps = torch.randn_like(self.x0)
        per, raw, wl, x0e = mref.loss(self.out, self.x0, eps, self.t, self.w, self.iw, self.tab, self.gate)
        per.mean().backward()
        self.bins.scatter_(self.t, torch.cat([raw[None], wl[None], x0e.T]).detach())

    def fused(self, backend, **kw):
        self._zero()
        res = ops_mixed.mixed_loss(self.out, self.x0, self.t, self.w, self.iw, self.tab, gate=self.gate,
                                   bins=self.bins, backend=backend, **kw)
        res.loss.backward()

    def torch(self):
        self.fused("torch", eps=self.eps)

    def native(self):
        self.fused("native", seed=1, offset=0)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(gate: str) -> dict[str, list[float]]:
    case = Case(gate)
    impls = ["reference", "torch", "native"]
    for impl in impls:  # warm up (allocator, thread pool)
        getattr(case, impl)()
    times = {impl: [] for impl in impls}
    for r in range(ROUNDS):
        order = impls[r % len(impls):] + impls[: r % len(impls)]
        for impl in order:
            times[impl].append(timed(getattr(case, impl)))
    return times


def main():
    if not native.available("cpu"):
        sys.exit("fasttrain._C is not built: nothing to compare")
    torch.set_num_threads(int(os.environ.get("FASTTRAIN_BENCH_THREADS", "2")))
    rows = []
    for gate in ("pixel", "timestep"):
        times = run(gate)
        med = {impl: statistics.median(ts) for impl, ts in times.items()}
        for impl, ts in times.items():
            rows.append({"gate": gate, "impl": impl, "median_ms": med[impl] * 1e3, "min_ms": min(ts) * 1e3,
                         "x_vs_reference": med["reference"] / med[impl],
                         "x_vs_reference_min": min(times["reference"]) / min(ts), "times_s": ts})
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "shape": list(SHAPE),
           "heads": list(HEADS), "rounds": ROUNDS, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    name = "mixed-native-cpu" + (f"-{torch.get_num_threads()}thread" if torch.get_num_threads() != 2 else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2))
    lines = ["# Mixed-prediction loss per step (forward + backward), cpu", "",
             f"machine: {json.dumps(out['machine'])}  ", f"when: {out['when']}  ",
             f"batch: x0 fp32 {'×'.join(map(str, SHAPE))}, heads {', '.join(HEADS)}, bf16 network output, "
             f"bins of {2 + len(HEADS)} values", "",
             "| gate | impl | median ms | min ms | × vs reference (medians) | × (minima) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gate']} | {r['impl']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | "
                     f"{r['x_vs_reference']:.2f} | {r['x_vs_reference_min']:.2f} |")
    lines += ["", f"{ROUNDS} interleaved rounds per gate (every implementation once per round, rotating order), "
              f"{torch.get_num_threads()} threads on a shared machine (load average in `machine`), so the minima are "
              "shown too. reference: mixed_reference.loss under "
              "autograd with eps from torch's generator; torch: the closed-form backend with that eps given; "
              "native: fasttrain_C::mixed_loss drawing eps from the Philox stream in the op (bench/mixed_native.py)."]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
