"""The noise op (kernels/noise.py) alone: x_t = α[t]·x0 + σ[t]·ε for one batch, against the PyTorch
reference math; forward only (the trainer's x0 needs no gradient).

    python bench/bench_noise.py      # writes bench/results/noise-<device>.{md,json}

Implementations (cases.impls):
  eager        torch.randn_like + torch_ref.noise: ε drawn by torch's generator and kept, x_t written
  compile_ref  the same under torch.compile
  native       the op's "native" backend (fasttrain_C::noise): ε from the Philox stream inside the op
  triton       the op's "triton" backend (CUDA only)
The loss op regenerates the same ε: the two ops timed together, as a step runs them, are
bench_diffusion_loss.py. Byte floor: x0 read, x_t written in the model's dtype (bf16 here). Interleaved
rounds (bench/interleaved.py); on CPU FASTTRAIN_BENCH_THREADS threads (default 2).
"""
from __future__ import annotations

import os

import _env  # noqa: F401  (OpenMP's wait policy, before torch loads it)
import torch
from cases import SHAPES, impls, machine
from interleaved import interleave, rows_of, write

from fasttrain import diffusion as fd
from fasttrain.kernels import torch_ref
from fasttrain.kernels.noise import noise


class Case:
    def __init__(self, shape, device, model_dtype=torch.bfloat16, seed: int = 0):
        self.device = torch.device(device)
        s = fd.schedule("linear", T=1000)
        self.a, self.s = s.alpha.float().to(device), s.sigma.float().to(device)
        g = torch.Generator(device).manual_seed(seed)
        self.x0 = torch.rand(shape, generator=g, device=device) * 2 - 1
        self.t = torch.randint(0, 1000, (shape[0],), generator=g, device=device)
        self.offset = torch.zeros((), dtype=torch.int64, device=device)
        self.model_dtype = model_dtype
        self.compiled = None

    @property
    def floor_bytes(self) -> int:
        return self.x0.numel() * (self.x0.element_size() + torch.empty((), dtype=self.model_dtype).element_size())

    def _reference(self, x0, t):
        return torch_ref.noise(x0, t, self.a, self.s, torch.randn_like(x0), self.model_dtype)

    def eager(self):
        return self._reference(self.x0, self.t)

    def compile_ref(self):
        if self.compiled is None:
            self.compiled = torch.compile(self._reference)
        return self.compiled(self.x0, self.t)

    def fused(self, backend):
        return noise(self.x0, self.t, self.a, self.s, seed=1, offset=self.offset, out_dtype=self.model_dtype,
                     backend=backend)

    def triton(self):
        return self.fused("triton")

    def native(self):
        return self.fused("native")


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("FASTTRAIN_BENCH_THREADS", "2")))
    names, rounds, rows = impls(device), (20 if device.type == "cuda" else 7), []
    for shape_name, shape in SHAPES.items():
        case = Case(shape, device)
        times = interleave({n: getattr(case, n) for n in names}, device, rounds)
        for r in rows_of(times, "eager", shape=shape_name):
            r["floor_GBps"] = case.floor_bytes / (r["median_ms"] / 1e3) / 1e9
            rows.append(r)
    threads = torch.get_num_threads()
    name = f"noise-{device.type}" + (f"-{threads}thread" if device.type == "cpu" and threads != 2 else "")
    table = ["| batch | impl | median ms | min ms | GB/s at the byte floor | × vs eager (medians) |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['shape']} {'×'.join(map(str, SHAPES[r['shape']]))} | {r['impl']} | {r['median_ms']:.2f} | "
              f"{r['min_ms']:.2f} | {r['floor_GBps']:.1f} | {r['x_vs_eager']:.2f} |" for r in rows]
    notes = [f"{rounds} interleaved rounds per batch (every implementation once per round, rotating order), "
             f"{threads} threads on CPU (a shared machine: load average in `machine`); fp32 x0, bf16 x_t. "
             "eager/compile_ref draw ε with torch's generator; the fused backends draw it from the Philox stream."]
    write(name, f"The noise op, forward, {device.type}", {"machine": machine(), "device": device.type,
                                                          "rounds": rounds, "rows": rows}, table, notes)


if __name__ == "__main__":
    main()
