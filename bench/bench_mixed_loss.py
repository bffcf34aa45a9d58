"""The mixed-prediction loss op (kernels/mixed_loss.py), forward + backward, on one latent batch:
the PyTorch reference math against the fused backends of the device.

    python bench/bench_mixed_loss.py      # writes bench/results/mixed-loss-<device>.{md,json}
    python bench/bench_mixed_loss.py --shape 4x4x8x8 --rounds 2 --interpret   # a check on tiny shapes

Batch 256×4×32×32 (fp32 x0), heads (eps, x0, v) in a bf16 network output, pixel gate (3·4 + 3
channels) and timestep gate ([B, 3] logits); x0-space min-SNR weight, bins of 2 + 3 values.
Implementations:
  eager    torch_ref_mixed_loss.loss under autograd, eps from torch's generator, the bins scattered
           afterwards: what a trainer without fused kernels does
  torch    the op's "torch" backend: the closed-form gradients (torch_ref_mixed_loss.loss_and_grad),
           with the same explicit eps (its in-op Philox stream in plain PyTorch is a test tool, far slower)
  native   the op's "native" backend (fasttrain_C::mixed_loss, CPU only): eps regenerated from the
           Philox stream inside the op
  triton   the op's "triton" backend (the kernel of triton_mixed_loss.py, CUDA only): eps regenerated
           inside the kernel
What cannot run on the device is listed as skipped, with the reason. Interleaved rounds (every
implementation once per round, rotating order, so that load from other processes hits them alike);
ratios are of the medians. On CPU FASTTRAIN_BENCH_THREADS threads (default 2). On CUDA each round times
`--calls` calls back to back, and each implementation is also captured in a CUDA graph and replayed
(interleaved.graphed: the kernels' time without the host's dispatch).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cases import machine
from interleaved import graphed, interleave

from fasttrain import diffusion as fd
from fasttrain.diffusion import mixed as M
from fasttrain.kernels import TimestepBins, native, torch_ref_mixed_loss
from fasttrain.kernels.backend import has_triton
from fasttrain.kernels.mixed_loss import mixed_loss

SHAPE, HEADS, T, ROUNDS = (256, 4, 32, 32), ("eps", "x0", "v"), 1000, 21


def impls(device) -> tuple[list[str], dict[str, str]]:
    """(what runs on `device`, {what does not: why})."""
    device = torch.device(device)
    run, skipped = ["eager", "torch"], {}
    if device.type == "cpu" and native.available("cpu"):
        run.append("native")
    else:
        skipped["native"] = ("no CUDA version of the native mixed op (the Triton kernel is the GPU path)"
                             if device.type == "cuda" else native.why_not("cpu"))
    if device.type == "cuda" and has_triton():
        run.append("triton")
    else:
        skipped["triton"] = "needs CUDA tensors and triton (the interpreter is a correctness tool, not timed)"
    return run, skipped


class Case:
    def __init__(self, gate: str, device="cpu", shape=SHAPE, seed: int = 0):
        s = fd.schedule("linear", T=T)
        self.device = torch.device(device)
        self.w = fd.loss_weight("min_snr", s, "x0").float().to(device)
        self.tab = M.head_table(HEADS, s).to(device)
        g = torch.Generator().manual_seed(seed)
        B, C, H = shape[0], shape[1], len(HEADS)
        self.x0 = (torch.rand(shape, generator=g) * 2 - 1).to(device)
        self.t = torch.randint(0, T, (B,), generator=g).to(device)
        self.iw = torch.ones(B, device=device)
        width = H * C + (H if gate == "pixel" else 0)
        self.out = (torch.randn(B, width, *shape[2:], generator=g) * 0.5).bfloat16().to(device).requires_grad_()
        self.gate = torch.randn(B, H, generator=g).to(device).requires_grad_() if gate == "timestep" else None
        self.eps = torch.randn(shape, generator=g).to(device)
        self.bins = TimestepBins(T, 2 + H, device)

    def _zero(self):
        self.out.grad = None
        if self.gate is not None:
            self.gate.grad = None

    def eager(self):
        self._zero()
        eps = torch.randn_like(self.x0)
        per, raw, wl, x0e = torch_ref_mixed_loss.loss(self.out, self.x0, eps, self.t, self.w, self.iw, self.tab,
                                                      self.gate)
        per.mean().backward()
        self.bins.scatter_(self.t, torch.cat([raw[None], wl[None], x0e.T]).detach())
        return per.mean()

    def fused(self, backend, **kw):
        self._zero()
        res = mixed_loss(self.out, self.x0, self.t, self.w, self.iw, self.tab, gate=self.gate,
                         bins=self.bins, backend=backend, **kw)
        res.loss.backward()
        return res.loss

    def torch(self):
        return self.fused("torch", eps=self.eps)

    def native(self):
        return self.fused("native", seed=1, offset=0)

    def triton(self):
        return self.fused("triton", seed=1, offset=0)

    def interpret(self):  # the Triton kernel in the interpreter (CPU; --interpret: a check, not a timing)
        return self.fused("interpret", seed=1, offset=0)


def run(gate: str, device, names: list[str], shape=SHAPE, rounds: int = ROUNDS, calls: int = 1,
        capture="auto") -> dict[str, list[float]]:
    """{impl: seconds per call per round}, and with `capture` (interleaved.graphed, the default on CUDA)
    {impl + " graph": seconds per replay of the call captured}."""
    case = Case(gate, device, shape)  # each implementation warmed up once (allocator, thread pool, Triton compilation)
    fns = {impl: getattr(case, impl) for impl in names}
    if capture == "auto":
        capture = graphed if case.device.type == "cuda" else None
    if capture is not None:
        for impl in names:
            try:
                fns[f"{impl} graph"] = capture(getattr(case, impl))
            except Exception as e:  # the plain timing goes on; the log says why
                print(f"{gate} {impl}: not captured in a CUDA graph ({type(e).__name__}: {e})", flush=True)
                if case.device.type == "cuda":
                    torch.cuda.synchronize()
    return interleave(fns, case.device, rounds, calls)


def rows_of(gate: str, times: dict[str, list[float]], names: list[str]) -> list[dict]:
    """One gate's rows from `run`'s times: per implementation the medians and minima of its plain calls,
    and where it was captured, its CUDA graph's median and the ratio to eager's graph."""
    med = {impl: statistics.median(ts) for impl, ts in times.items()}
    rows = []
    for impl in names:
        ts = times[impl]
        g = med.get(f"{impl} graph")
        rows.append({"gate": gate, "impl": impl, "median_ms": med[impl] * 1e3, "min_ms": min(ts) * 1e3,
                     "graph_ms": g * 1e3 if g else None,
                     "x_vs_eager": med["eager"] / med[impl],
                     "x_vs_eager_graph": med["eager graph"] / g if g and "eager graph" in med else None,
                     "x_vs_eager_min": min(times["eager"]) / min(ts), "times_s": ts,
                     "graph_times_s": times.get(f"{impl} graph")})
    return rows


def table(rows: list[dict], skipped: dict[str, str], ms: str = "{:.4f}") -> list[str]:
    """The markdown table of `rows_of`'s rows, the skipped implementations last; `ms`: the format of a
    time in ms (fewer digits on CPU). A graph column reads "—" where nothing was captured (CPU)."""
    lines = ["| gate | impl | median ms | min ms | CUDA graph ms | × vs eager (medians) | × (minima) | × (graphs) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = ms.format(r["graph_ms"]) if r["graph_ms"] else "—"
        xg = f"{r['x_vs_eager_graph']:.2f}" if r["x_vs_eager_graph"] else "—"
        lines.append(f"| {r['gate']} | {r['impl']} | {ms.format(r['median_ms'])} | {ms.format(r['min_ms'])} | {g} | "
                     f"{r['x_vs_eager']:.2f} | {r['x_vs_eager_min']:.2f} | {xg} |")
    return lines + [f"| both | {impl} | skipped: {why} | | | | | |" for impl, why in skipped.items()]


def main(argv=None):
    from bench_diffusion_loss import shape_arg

    ap = _env.Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=shape_arg, default={"latent": SHAPE}, help="BxCxHxW of x0")
    ap.add_argument("--rounds", type=_env.count(), default=ROUNDS)
    ap.add_argument("--calls", type=_env.count(), default=None,
                    help="calls back to back per round (default 20 on CUDA, 1 on CPU)")
    ap.add_argument("--interpret", action="store_true", help="on CPU also the Triton kernel in the interpreter")
    ap.add_argument("--out", type=_env.stem, default=None, help="result stem (default mixed-loss-<device>)")
    args = ap.parse_args(argv)
    if len(args.shape) != 1:
        ap.error("--shape takes one shape")
    (shape,) = args.shape.values()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    calls = args.calls or (20 if device.type == "cuda" else 1)
    names, skipped = impls(device)
    if args.interpret and device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (kernels/backend.py)
        names.append("interpret")
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("FASTTRAIN_BENCH_THREADS", "2")))
    rows = [r for gate in ("pixel", "timestep")
            for r in rows_of(gate, run(gate, device, names, shape, args.rounds, calls), names)]
    threads = torch.get_num_threads()
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "command": " ".join(sys.argv),
           "device": device.type, "shape": list(shape), "heads": list(HEADS), "rounds": args.rounds,
           "calls_per_round": calls, "rows": rows, "skipped": skipped}
    name = args.out or (f"mixed-loss-{device.type}" +
                        (f"-{threads}thread" if device.type == "cpu" and threads != 2 else ""))
    lines = [f"# Mixed-prediction loss per step (forward + backward), {device.type}", "",
             f"machine: {json.dumps(out['machine'])}  ", f"when: {out['when']}  ", f"command: `{out['command']}`  ",
             f"batch: x0 fp32 {'×'.join(map(str, shape))}, heads {', '.join(HEADS)}, bf16 network output, "
             f"bins of {2 + len(HEADS)} values", ""]
    lines += table(rows, skipped, "{:.1f}" if device.type == "cpu" else "{:.4f}")
    where = f"{threads} threads on a shared machine (load average in `machine`)" if device.type == "cpu" else "one GPU"
    lines += ["", f"{args.rounds} interleaved rounds of {calls} calls per gate (every implementation once per round, "
              "rotating order), "
              f"{where}, so the minima are shown too. eager: torch_ref_mixed_loss.loss under autograd with eps "
              "from torch's generator; torch: the op's closed-form torch backend with that eps given; native, "
              "triton: the fused backends, drawing eps from the Philox stream in the op (bench/bench_mixed_loss.py)."]
    with _env.Results() as res:
        res.text(f"{name}.json", json.dumps(out, indent=2))
        res.text(f"{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    _env.run(main)
