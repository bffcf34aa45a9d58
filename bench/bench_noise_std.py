"""The noise_std op (kernels/noise_std.py): the batch-global std of pyramid noise, reduced before the
noise op, against what sd-scripts' pyramid_noise_like computes for it in PyTorch.

    python bench/bench_noise_std.py      # writes bench/results/noise-std-<device>.{md,json}

Pyramid noise with 6 levels (discount 0.3, sd-scripts' settings for SD latents: multires_noise_iterations
6-10). Implementations:
  eager        sd-scripts' way: each level a torch.randn field upsampled by F.interpolate (bilinear) and
               added, then `.std()` of the sum (every level materialised)
  compile_ref  the same under torch.compile
  native       the op's "native" backend (fasttrain_C::noise_std): the levels regenerated from the Philox
               stream per element, Σ and Σ² reduced, nothing stored
  triton       the op's "triton" backend (CUDA only; triton_noise_spec.moments)
Interleaved rounds (bench/interleaved.py); on CPU FASTTRAIN_BENCH_THREADS threads (default 2).
"""
from __future__ import annotations

import os

import _env  # noqa: F401  (OpenMP's wait policy, before torch loads it)
import torch
import torch.nn.functional as F
from cases import impls, machine
from interleaved import interleave, rows_of, write

from fasttrain.kernels import noise_spec
from fasttrain.kernels.noise_prepare import prepare as prepare_noise
from fasttrain.kernels.noise_std import noise_std

SHAPES = {"latent-dit": (256, 4, 32, 32), "latent-sd": (16, 4, 64, 64)}
LEVELS, DISCOUNT = 6, 0.3


class Case:
    def __init__(self, shape, device, seed: int = 0):
        self.device = torch.device(device)
        g = torch.Generator(device).manual_seed(seed)
        self.x0 = torch.rand(shape, generator=g, device=device) * 2 - 1
        self.spec, _ = prepare_noise(noise_spec.NoiseOptions(pyramid_iterations=LEVELS, pyramid_discount=DISCOUNT),
                                          self.x0, seed=1, offset=0, backend="torch")
        self.offset = torch.zeros((), dtype=torch.int64, device=device)
        self.compiled = None

    def _reference(self, x0):
        B, C, H, W = x0.shape
        noise = torch.randn_like(x0)
        for i in range(LEVELS):  # sd-scripts pyramid_noise_like, r = 3 (the mean of its U[2, 4) draw)
            h, w = max(1, int(H / 3**i)), max(1, int(W / 3**i))
            noise = noise + F.interpolate(torch.randn(B, C, h, w, device=x0.device), size=(H, W),
                                          mode="bilinear") * DISCOUNT**i
            if h == 1 or w == 1:
                break
        return noise.std()

    def eager(self):
        return self._reference(self.x0)

    def compile_ref(self):
        if self.compiled is None:
            self.compiled = torch.compile(self._reference)
        return self.compiled(self.x0)

    def fused(self, backend):
        return noise_std(self.x0, self.spec, seed=1, offset=self.offset, backend=backend)

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
        rows += rows_of(interleave({n: getattr(case, n) for n in names}, device, rounds), "eager", shape=shape_name)
    threads = torch.get_num_threads()
    name = f"noise-std-{device.type}" + (f"-{threads}thread" if device.type == "cpu" and threads != 2 else "")
    table = ["| batch | impl | median ms | min ms | × vs eager (medians) |", "|---|---|---|---|---|"]
    table += [f"| {r['shape']} {'×'.join(map(str, SHAPES[r['shape']]))} | {r['impl']} | {r['median_ms']:.2f} | "
              f"{r['min_ms']:.2f} | {r['x_vs_eager']:.2f} |" for r in rows]
    notes = [f"{rounds} interleaved rounds per batch (every implementation once per round, rotating order), "
             f"{threads} threads on CPU (a shared machine: load average in `machine`); {LEVELS} pyramid levels, "
             f"discount {DISCOUNT}. eager/compile_ref materialise every level (sd-scripts); the fused backends "
             "regenerate them per element from the Philox stream."]
    write(name, f"The pyramid noise's std (noise_std op), {device.type}",
          {"machine": machine(), "device": device.type, "rounds": rounds, "levels": LEVELS, "rows": rows},
          table, notes)


if __name__ == "__main__":
    main()
