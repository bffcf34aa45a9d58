"""What torch.compile (inductor) generates for fasttrain, compiled for sm_80 and sm_90 without a GPU,
with the resources and access widths of each generated Triton kernel and autotuning config.

    python bench/inductor_aot.py [--arch 80 90] [--json PATH]

Graphs: the reference math, which `torch.compile(reference)` runs in bench/bench_diffusion_loss.py
and the ops' `torch` backend computes (the noise with eps from the Philox stream, philox.py; the
diffusion loss with its gradient; the mixed loss with its gradients: torch_ref.py,
torch_ref_mixed_loss.py), and the forward pass of two models as the trainer runs them (bf16 autocast):
the default run's unet_tiny and dit_tiny. fasttrain's ops themselves are opaque custom ops: inductor
generates no code for them. The models' backward is not here: tracing it runs the autograd engine,
which asks the CUDA runtime for a device context (`hasPrimaryContext`), and there is none.

This needs private APIs of torch 2.14 and triton 3.8 and breaks on upgrades, which is why it is a
bench script and not a test: inductor asks the CUDA driver for the device's properties, for the
active Triton driver and, after compiling, for a context to load the binaries into. Here a
codegen-only driver answers with the target, the device properties are those of an A100 or H100,
constant folding (which would run ops on the device) is off, and launcher creation (which loads the
cubin) is skipped: each Triton kernel and every autotuning config inductor lists for it are still
compiled by triton.compile for the target, as on a GPU machine, and read from there (on a GPU the
autotuner would then time the configs and keep one). Each target runs in its own process.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

PROPS = collections.namedtuple("Props", "name major minor multi_processor_count regs_per_multiprocessor "
                               "max_threads_per_multi_processor max_threads_per_block warp_size total_memory "
                               "shared_memory_per_block_optin gcnArchName L2_cache_size")
DEVICES = {80: PROPS("NVIDIA A100 (fake)", 8, 0, 108, 65536, 2048, 1024, 32, 80 << 30, 166912, "", 40 << 20),
           90: PROPS("NVIDIA H100 (fake)", 9, 0, 132, 65536, 2048, 1024, 32, 80 << 30, 232448, "", 50 << 20)}


def patch_for(sm: int, harvest: list) -> None:
    """Make inductor compile for sm_<sm> without a device (see the module docstring)."""
    import torch
    import triton
    from torch._dynamo.device_interface import CudaInterface
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    props = DEVICES[sm]
    for obj in (CudaInterface, CudaInterface.Worker):
        obj.get_device_properties = staticmethod(lambda device=None: props)
        obj.current_device = staticmethod(lambda: 0)
    CudaInterface.get_compute_capability = staticmethod(lambda device=None: sm)
    CudaInterface.is_available = staticmethod(lambda: True)
    CudaInterface.is_bf16_supported = staticmethod(lambda including_emulation=False: True)
    torch.cuda.is_bf16_supported = lambda including_emulation=True: True
    CudaInterface.device_count = staticmethod(lambda: 1)
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.get_device_capability = lambda device=None: (props.major, props.minor)
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda device=None: props.name

    class CodegenDriver(DriverBase):  # a target, no device
        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_current_target(self):
            return GPUTarget("cuda", sm, 32)

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

        def get_benchmarker(self):
            raise NotImplementedError

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cuda

    triton.runtime.driver.set_active(CodegenDriver())
    import torch._inductor.runtime.triton_helpers as th
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    th.set_driver_to_gpu = lambda: None

    def keep(self):  # instead of loading the binaries: keep what was compiled
        for r in self.compile_results:
            harvest.append(dict(kernel=self.fn.__name__, config=dict(r.config.kwargs), num_warps=r.config.num_warps,
                                num_stages=r.config.num_stages, ptx=r.kernel.asm["ptx"],
                                triton_smem=r.kernel.metadata.shared))

    CachingAutotuner._make_launchers = keep
    CachingAutotuner._dynamic_scale_rblock = lambda self: None


def graphs():
    """(name, function, example inputs as fake CUDA tensors): the reference math of the three ops."""
    import torch

    from fasttrain.kernels import philox, torch_ref, torch_ref_mixed_loss

    B, C, S, T = 8, 3, 32, 1000  # 8 RGB 32×32 images: rows of 3072, planes of 1024
    f32, bf16 = dict(device="cuda", dtype=torch.float32), dict(device="cuda", dtype=torch.bfloat16)
    t = torch.zeros(B, dtype=torch.int64, device="cuda")
    tab, x0 = torch.empty(T, **f32), torch.empty(B, C, S, S, **f32)

    def noise(x0, t, alpha, sigma, offset):
        return torch_ref.noise(x0, t, alpha, sigma, philox.randn(x0.shape, 1, offset, x0.device), torch.bfloat16)

    def loss(pred, x0, eps, t, weight, iw, coef):
        return torch_ref.loss_and_grad(pred, x0, eps, t, weight, iw, coef)

    def mixed(out, x0, eps, t, weight, iw, tab):
        return torch_ref_mixed_loss.loss_and_grad(out, x0, eps, t, weight, iw, tab)

    def model_forward(name, in_channels, shape):
        from torch.func import functional_call

        from fasttrain.models import build_model

        model = build_model(name, in_channels=in_channels, image_size=shape[-1])
        names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]

        def forward(x, t, *tensors):  # the trainer's forward: bf16 autocast on CUDA (precision.py)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return functional_call(model, dict(zip(names, tensors)), (x, t))

        state = [*model.parameters(), *model.buffers()]
        return (f"{name} forward ({shape[0]}×{in_channels}×{shape[-1]}², bf16 autocast)", forward,
                (torch.empty(*shape, **f32), torch.zeros(shape[0], dtype=torch.int64, device="cuda"),
                 *(torch.empty(v.shape, dtype=v.dtype, device="cuda") for v in state)))

    H, nrows = 2, torch_ref_mixed_loss.NROWS
    return [
        ("noise (x_t in bf16, eps from philox.randn)", noise,
         (x0, t, tab, tab, torch.zeros((), dtype=torch.int64, device="cuda"))),
        ("diffusion loss + gradient (v, bf16 prediction)", loss,
         (torch.empty(B, C, S, S, **bf16), x0, torch.empty(B, C, S, S, **f32), t, tab, torch.empty(B, **f32),
          torch.empty(2, T, **f32))),
        ("mixed loss + gradients (2 heads, pixel gate, bf16 output)", mixed,
         (torch.empty(B, H * C + H, S, S, **bf16), x0, torch.empty(B, C, S, S, **f32), t, tab,
          torch.empty(B, **f32), torch.empty(H, nrows, T, **f32))),
        model_forward("unet_tiny", 1, (16, 1, 8, 8)),  # the default run's model and data
        model_forward("dit_tiny", 4, (32, 4, 8, 8)),
    ]


def run_target(sm: int) -> list[dict]:
    """Compile the graphs for sm_<sm> in this process; one row per generated kernel and config."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    harvest: list = []
    patch_for(sm, harvest)
    import torch._inductor.config as icfg
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    from fasttrain.kernels import aot_inspect

    icfg.compile_threads = 1
    icfg.joint_graph_constant_folding = False  # it would run aten ops on the (absent) device
    icfg.use_static_cuda_launcher = False  # keep Triton's CompiledKernel (with its PTX) as the result
    kernels = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        for name, fn, inputs in graphs():
            start = len(harvest)
            compile_fx(make_fx(fn)(*inputs), list(inputs))
            kernels += [dict(graph=name, **k) for k in harvest[start:]]
    rows = []
    for k in kernels:
        arch = next(ln.split()[1] for ln in k["ptx"].splitlines() if ln.startswith(".target"))
        res = aot_inspect.parse_ptxas(aot_inspect.ptxas_report(k["ptx"], arch))
        widths: dict = collections.Counter()
        for acc in aot_inspect.accesses_by_line(k["ptx"]).values():
            widths.update(f"{op}{bits}" for op, bits in acc if op in ("ld", "st"))
        rows.append(dict(graph=k["graph"], arch=sm, kernel=k["kernel"], config=k["config"], num_warps=k["num_warps"],
                         triton_smem=k["triton_smem"], accesses=dict(sorted(widths.items())), **res))
    return rows


def markdown(res: dict) -> list[str]:
    """The inductor section of bench/results/kernels-aot.md: per graph and target, then every kernel."""
    if "error" in res:
        return [f"Not produced here: {res['error'].strip().splitlines()[-1]}"]
    rows = res["rows"]
    out = [f"{len(rows)} generated kernels × autotuning configs over both targets, compiled in "
           f"{res.get('seconds', '?')} s (python bench/inductor_aot.py; private torch/triton APIs, see its "
           "docstring). Widths: every global load (ld) and store (st) of the kernels, bits × count.", "",
           "| graph | target | kernels | configs | registers min / median / max | spill bytes | stack | "
           "global accesses |", "|---|---|---|---|---|---|---|---|"]
    for graph in dict.fromkeys(r["graph"] for r in rows):
        for arch in sorted({r["arch"] for r in rows}):
            rs = [r for r in rows if r["graph"] == graph and r["arch"] == arch]
            regs = sorted(r["registers"] for r in rs)
            acc: dict = collections.Counter()
            for r in rs:
                acc.update(r["accesses"])
            spills = max(r["spill_stores"] + r["spill_loads"] for r in rs)
            out.append(f"| {graph} | sm_{arch} | {len({r['kernel'] for r in rs})} | {len(rs)} | {regs[0]} / "
                       f"{regs[len(regs) // 2]} / {regs[-1]} | {spills} | "
                       f"{'/'.join(map(str, sorted({r['stack'] for r in rs})))} | "
                       f"{', '.join(f'{k}×{v}' for k, v in sorted(acc.items()))} |")
    out += ["", "<details><summary>Every generated kernel and config</summary>", "",
            "| graph | kernel | config | target | registers | spills st/ld | stack | shared (Triton + static) | "
            "global accesses |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cfg = " ".join(f"{k}={v}" for k, v in r["config"].items()) + f" warps={r['num_warps']}"
        acc = ", ".join(f"{k}×{v}" for k, v in r["accesses"].items())
        name = r["kernel"] if len(r["kernel"]) <= 40 else r["kernel"][:37] + "…"
        out.append(f"| {r['graph']} | `{name}` | {cfg} | sm_{r['arch']} | {r['registers']} | "
                   f"{r['spill_stores']}/{r['spill_loads']} | {r['stack']} | {r['triton_smem']} + {r['smem']} | "
                   f"{acc} |")
    return out + ["", "</details>"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--json")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: compile for one target, print JSON
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_target(a.one)))
        return 0
    rows = []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as cache:
        for sm in a.arch:  # fresh caches: the generated code and its binaries, per target
            env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, f"inductor{sm}"),
                       TRITON_CACHE_DIR=os.path.join(cache, f"triton{sm}"))
            run = subprocess.run([sys.executable, __file__, "--one", str(sm)], env=env, capture_output=True,
                                 text=True)
            if run.returncode:
                print(run.stderr[-5000:], file=sys.stderr)
                return 1
            rows += json.loads(run.stdout.strip().splitlines()[-1])
    res = dict(rows=rows)
    for line in markdown(res):
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
