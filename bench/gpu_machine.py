"""The lent GPU machine as this project's GPU check sees it: what it holds, what travels to it as wheels
(bench/gpu_wheels.txt), and a simulation of it for the CPU dry run.

    python bench/gpu_machine.py --report [--site DIR]   # versions, GPU, native build: gpu-machine.{json,md}
    python bench/gpu_machine.py --lacks                 # every package our code imports that must travel

The machine (one NVIDIA H200, Python 3.12, no network; as read there in 2026-11) holds the packages of
HOLDS, some with the versions read there (VERSIONS). What it lacks travels as wheels: bench/gpu_wheels.sh
downloads bench/gpu_wheels.txt's pins into wheels/, and bench/gpu_plan.py installs them there with
`pip install --no-index --no-deps --target SITE wheels/*.whl` and puts SITE on PYTHONPATH.

The simulation (`Guard`, installed in every process of the dry run by bench/gpu_sim/sitecustomize.py):
an import made by this repository's code (fasttrain, kernels, bench, tests) or by a carried package, of a
distribution the machine lacks and no wheel carries, fails as it would there (ModuleNotFoundError, and
`importlib.util.find_spec` answers None), and is logged; a carried package is loaded from SITE, the
wheelhouse installed as there, when there is one (else from this environment, checked against the list).
Imports made by the packages the machine holds are theirs (their versions there differ from ours here)
and are left alone.
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WHEELS_TXT = BENCH / "gpu_wheels.txt"  # FASTTRAIN_GPU_WHEELS names another list (tests: a wheel left out)

# the distributions of the machine's image 'cuda' (read there on 2026-11-17)
HOLDS = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split()
# versions read there (2026-11; the rest were not read): python 3.12.3 at /opt/torch/.venv/bin/python3
VERSIONS = {"torch": "2.11.0", "triton": "3.6.0", "torchvision": "0.26.0", "transformers": "5.17.0",
            "huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "safetensors": "0.8.0", "accelerate": "1.15.0",
            "numpy": "2.5.2"}
PYTHON = (3, 12)
PROJECT = "fasttrain"  # installed there from the tree itself (pip install -e .)
# namespace packages whose parts belong to different distributions: the part decides
SUBMODULES = {"nvidia.dali": "nvidia-dali-cuda130"}


def norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def wheels() -> dict[str, str]:
    """{distribution: pinned version} of bench/gpu_wheels.txt ("name==version  # why" lines)."""
    out = {}
    for line in Path(os.environ.get("FASTTRAIN_GPU_WHEELS") or WHEELS_TXT).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version.strip()
    return out


def lacks(dist: str) -> bool:
    return norm(dist) not in {norm(d) for d in HOLDS}


def distributions_of(name: str, owner: dict[str, list[str]]) -> list[str]:
    """The distributions (normalised) a module `name` comes from here, [] for the standard library and
    this repository's own modules; `owner`: packages_distributions(), normalised."""
    for k, d in SUBMODULES.items():
        if name == k or name.startswith(k + "."):
            return [d]
    return [d for d in owner.get(name.partition(".")[0], []) if d not in SUBMODULES.values() and d != PROJECT]


class Guard(importlib.abc.MetaPathFinder):
    """The machine's import rules in this process (module docstring)."""

    def __init__(self, site: str | None = None, log: str | None = None):
        self.site = site if site and Path(site).is_dir() else None
        self.log = log
        self.holds = {norm(d) for d in HOLDS}
        self.carried = set(wheels())
        self.owner = {m: [norm(d) for d in ds] for m, ds in importlib.metadata.packages_distributions().items()}
        self.carried_modules = {m for m, ds in self.owner.items() if set(ds) & self.carried}

    def verdict(self, name: str) -> tuple[str, str] | None:
        """None (not a distribution's, or one the machine holds), or (kind, distribution): kind "carried"
        (a wheel brings it; a wheel wins over the machine's own copy, as SITE comes first on PYTHONPATH
        there) or "missing"."""
        dists = distributions_of(name, self.owner)
        carried = [d for d in dists if d in self.carried]
        if carried:
            return "carried", carried[0]
        if not dists or any(d in self.holds for d in dists):
            return None
        return "missing", dists[0]

    @staticmethod
    def importer() -> tuple[str, str]:
        """(module name, file) of the code that asked for the import: the first frame outside importlib
        and the guard."""
        skip = {importlib.util.__file__, importlib.__file__}
        f = sys._getframe(1)
        while f is not None and (f.f_code.co_filename.startswith("<frozen") or f.f_code.co_filename in skip
                                 or f.f_code in _GUARD_CODE):
            f = f.f_back
        if f is None:
            return "", ""
        return f.f_globals.get("__name__", "") or "", f.f_code.co_filename

    def checked(self, module: str, file: str) -> bool:
        """Whether the machine's rules apply to imports made there: our code, or a carried package."""
        ours = file.startswith(str(REPO) + os.sep) and not file.startswith(str(REPO / ".venv") + os.sep)
        return ours or module.partition(".")[0] in self.carried_modules

    def _note(self, text: str) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(text + "\n")

    def blocked(self, name: str) -> str | None:
        """Why `name` cannot be imported on the machine by its importer here, or None."""
        v = self.verdict(name)
        if v is None:
            return None
        module, file = self.importer()
        if v[0] == "carried":
            self._note(f"carried {v[1]} {name} <- {module or file}")
            return None
        if not self.checked(module, file):
            return None
        self._note(f"missing {v[1]} {name} <- {module or file}")
        return (f"No module named {name!r}: the lent GPU machine lacks {v[1]} and bench/gpu_wheels.txt carries no "
                f"wheel of it (imported by {module or file}; the GPU check's dry run simulates the machine)")

    def find_spec(self, name, path=None, target=None):
        if path is not None and not any(name == k or name.startswith(k + ".") for k in SUBMODULES):
            return None  # a submodule: its parent's location decides
        why = self.blocked(name)
        if why:
            raise ModuleNotFoundError(why, name=name)
        v = self.verdict(name)
        if v and v[0] == "carried" and self.site and path is None:
            spec = importlib.machinery.PathFinder.find_spec(name, [self.site])
            if spec is None:
                raise ModuleNotFoundError(f"No module named {name!r} in the wheelhouse installed at {self.site}, "
                                          f"though bench/gpu_wheels.txt carries {v[1]}", name=name)
            return spec
        return None


_GUARD_CODE = {Guard.blocked.__code__, Guard.find_spec.__code__}


def install(site: str | None, log: str | None) -> Guard:
    """The guard first on sys.meta_path, and importlib.util.find_spec answering None where it blocks."""
    guard = Guard(site, log)
    sys.meta_path.insert(0, guard)
    plain = importlib.util.find_spec

    def find_spec(name, package=None):
        full = importlib.util.resolve_name(name, package) if name.startswith(".") else name
        if full not in sys.modules and guard.blocked(full):
            return None
        return plain(name, package)

    _GUARD_CODE.add(find_spec.__code__)
    importlib.util.find_spec = find_spec
    return guard


def our_imports() -> dict[str, set[str]]:
    """{distribution the machine lacks: {modules of ours that import it}} by reading fasttrain/, kernels/,
    bench/ and tests/ (top-level and function-level imports alike)."""
    import ast

    owner = {m: [norm(d) for d in ds] for m, ds in importlib.metadata.packages_distributions().items()}
    found: dict[str, set[str]] = {}
    for folder in ("fasttrain", "kernels", "bench", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                for name in names:
                    dists = distributions_of(name, owner)
                    if dists and all(lacks(d) for d in dists):
                        found.setdefault(dists[0], set()).add(str(path.relative_to(REPO)))
    return found


def report(site: str | None) -> dict:
    """What the GPU check runs on: interpreter, the versions of what it imports, the GPU, nvcc, the native
    extension; each carried wheel importable from `site`."""
    import platform
    import shutil
    import subprocess

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def run(cmd):
        if shutil.which(cmd[0]) is None:
            return f"{cmd[0]}: not found"
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return (out.stdout + out.stderr).strip()

    names = ["torch", "triton", "torchvision", "numpy", "transformers", "tokenizers", "huggingface-hub", "peft",
             "accelerate", "safetensors", "setuptools", "wheel", "pytest", "pytest-benchmark", "pytest-xdist",
             *wheels()]
    info = {"python": platform.python_version(), "executable": sys.executable, "cpus": os.cpu_count(),
            "versions": {n: version(n) for n in dict.fromkeys(names)}, "pinned_wheels": wheels(), "site": site,
            "nvidia_smi": run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                               "--format=csv"]),
            "nvcc": run(["nvcc", "--version"]).splitlines()[-1:]}
    import torch

    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "memory_GiB": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count,
                       "capability": f"{p.major}.{p.minor}"}
    from fasttrain.kernels import native

    info["native"] = {d: "built" if native.available(d) else native.why_not(d) for d in ("cpu", "cuda")}
    logs = sorted((REPO / "build").glob("native-*/build.log"), key=lambda p: p.stat().st_mtime)
    if logs:  # the install's CMake log (pip -q shows none of it): the CUDA architectures, a failed CUDA build
        info["native_build_log"] = {"path": str(logs[-1].relative_to(REPO)),
                                    "tail": logs[-1].read_text(errors="replace").splitlines()[-15:]}
    info["carried_imports"] = {}
    owner = importlib.metadata.packages_distributions()
    for dist in wheels():
        mods = sorted(m for m, ds in owner.items() if dist in map(norm, ds))
        own = dist.replace("-", "_")  # its own module, not a stray top-level one (torch-fidelity ships tests/)
        for m in [own] if own in mods else mods[:1]:
            try:
                mod = importlib.import_module(m)
                info["carried_imports"][dist] = getattr(mod, "__file__", "") or ""
            except Exception as e:  # the report says what failed
                info["carried_imports"][dist] = f"FAILED: {type(e).__name__}: {e}"
    return info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", action="store_true", help="write gpu-machine.{json,md} (bench/results or "
                                                           "FASTTRAIN_BENCH_RESULTS)")
    ap.add_argument("--lacks", action="store_true", help="list what our code imports that the machine lacks")
    ap.add_argument("--site", default=os.environ.get("FASTTRAIN_GPU_SITE"), help="the wheelhouse's --target folder")
    ap.add_argument("--import", dest="modules", nargs="+", default=[], metavar="MODULE",
                    help="import each MODULE as this repository's code does (under the dry run's guard: the "
                         "machine's answer), and print where it came from")
    args = ap.parse_args(argv)
    for name in args.modules:
        mod = importlib.import_module(name)
        print(f"{name}: {getattr(mod, '__file__', None)}")
    if args.lacks:
        carried = wheels()
        for dist, where in sorted(our_imports().items()):
            state = f"carried ({dist}=={carried[dist]})" if dist in carried else "NOT CARRIED"
            print(f"{dist}: {state}; imported by {', '.join(sorted(where)[:4])}{' …' if len(where) > 4 else ''}")
    if args.report:
        sys.path.insert(0, str(BENCH))
        from _env import Results

        info = report(args.site)
        lines = ["# The machine of the GPU check", "", "```", json.dumps(info, indent=2), "```"]
        with Results() as res:
            res.text("gpu-machine.json", json.dumps(info, indent=2))
            res.text("gpu-machine.md", "\n".join(lines) + "\n")
        print("\n".join(lines))
        failed = [d for d, v in info["carried_imports"].items() if v.startswith("FAILED")]
        if failed:
            raise SystemExit(f"gpu_machine.py: error: carried packages do not import: {', '.join(failed)}")


if __name__ == "__main__":
    main()
