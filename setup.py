"""fasttrain: a diffusion-model trainer that treats the timestep as a first-class object.

`kernels/` is installed as the subpackage `fasttrain.kernels` (a top-level `kernels` would collide
with other installed packages of that name). The native extension `fasttrain._C` (C++ CPU ops, and CUDA ops
where nvcc is found) is built by CMakeLists.txt during the install; it needs torch at build time, so
install with `--no-build-isolation` after torch (README). Without a compiler, CMake or torch the
install goes on without it, says so in one line, and fasttrain uses the torch backend (the PyTorch
reference math).

Environment: FASTTRAIN_NATIVE=0 skips the extension, =1 makes a failed build an error;
FASTTRAIN_CUDA=0 builds the CPU part only; FASTTRAIN_CUDA_ARCHS (CMake list, default "80-real;90");
FASTTRAIN_BUILD_DIR (default build/native-<interpreter and torch>); CMAKE (the cmake to run).
"""
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

# Runtime dependencies a GPU user gets too. torch is left as a range: on CUDA machines pip picks the
# matching CUDA build; constraints.txt pins the versions CI tests (torch 2.14.1 comes from local disk
# here and carries triton 3.8.0 as its own dependency on Linux).
INSTALL_REQUIRES = [
    "torch>=2.6",
    "torchvision>=0.21",
    "numpy>=1.24",
    "omegaconf>=2.3",      # structured configs, YAML presets, key=value overrides
    "pyyaml>=6",
    "tqdm>=4.60",          # progress bars
    "matplotlib>=3.7",     # per-timestep plots
    "scikit-learn>=1.3",   # bundled digits data set, toy distributions
    "tensorboard>=2.14",   # metrics (JSONL is always written as well)
    "pillow>=9",
    "torch-fidelity>=0.3",  # FID / KID / precision-recall (with the project's own offline extractor)
    "jinja2>=3",           # the HTML run report
    "scipy>=1.10",         # exact immiscible assignment on CPU tensors (scikit-learn needs it anyway)
]

DALI = ["nvidia-dali-cuda130>=2.0"]  # CPU pipelines work without a GPU (device_id=None)
# VAE latents, diffusers backbones, export to a diffusers pipeline (fasttrain/pretrained/vae.py,
# fasttrain/export/, models/diffusers_backbone.py); imported lazily: `import diffusers` costs seconds
DIFFUSERS = ["diffusers>=0.42,<0.43", "huggingface-hub>=1.32", "safetensors>=0.8"]
# WebDataset tar shards (fasttrain/data/shards.py: data.name=shards, data prepare --shards)
WEBDATASET = ["webdataset>=1.0,<1.1"]
# text-to-image: CLIP / T5 text encoders and tokenizers from a local pipeline folder
# (fasttrain/pretrained/text_encoders.py); 5.25 asks for the `kernels` package, which the project's indexes do not carry
TEXT = DIFFUSERS + ["transformers>=5.20,<5.25", "tokenizers>=0.22"]
# LoRA adapters on diffusers backbones (fasttrain/pretrained/lora.py: model.lora.rank) and their export
LORA = TEXT + ["peft>=0.21,<0.22"]
EXTRAS = {
    "dali": DALI,
    "diffusers": DIFFUSERS,
    "webdataset": WEBDATASET,
    "text": TEXT,
    "lora": LORA,
    "dev": ["pytest>=8", "pytest-benchmark>=4", "pytest-xdist>=3", "ruff>=0.17"] + DALI + LORA + WEBDATASET,
}



class CMakeBuild(build_ext):
    """Builds `fasttrain._C` with CMake (Ninja when present) into the place setuptools expects it
    (the package folder for editable installs). A failure leaves the extension out, with one line,
    unless FASTTRAIN_NATIVE=1."""

    def build_extensions(self):
        built = []
        for ext in self.extensions:
            why = self._skip_reason() or self._cmake(ext)
            if why is None:
                built.append(ext)
                continue
            if os.environ.get("FASTTRAIN_NATIVE") == "1":
                raise RuntimeError(f"fasttrain._C was not built: {why}")
            print(f"fasttrain: native extension fasttrain._C not built ({why}); "
                  "fasttrain will use the torch backend (the PyTorch reference math)", file=sys.stderr, flush=True)
        self.extensions = built  # so setuptools neither copies nor lists what was not built

    @staticmethod
    def _skip_reason():
        if os.environ.get("FASTTRAIN_NATIVE") == "0":
            return "FASTTRAIN_NATIVE=0"
        if shutil.which(os.environ.get("CMAKE", "cmake")) is None:
            return "cmake not found"
        return None

    def _cmake(self, ext):
        try:
            import torch
            import torch.utils
        except ImportError:
            return "torch is not importable at build time: install torch first and use --no-build-isolation"
        # A build folder per interpreter and torch (CMake caches their paths), kept between installs
        # so that a re-install rebuilds only what changed; the log stays there too.
        key = hashlib.sha1(f"{sys.executable} {torch.__version__}".encode()).hexdigest()[:8]
        build_dir = Path(os.environ.get("FASTTRAIN_BUILD_DIR") or ROOT / "build" / f"native-{key}")
        build_dir.mkdir(parents=True, exist_ok=True)
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        cuda = os.environ.get("FASTTRAIN_CUDA", "AUTO")
        cuda = {"0": "OFF", "1": "ON"}.get(cuda, cuda)
        args = [f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DPython_EXECUTABLE={sys.executable}",
                f"-DFASTTRAIN_OUTPUT_DIR={out_dir}", f"-DFASTTRAIN_CUDA={cuda}",
                f"-DFASTTRAIN_TORCH_CUDA={'ON' if torch.version.cuda else 'OFF'}",
                f"-DFASTTRAIN_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", "-DCMAKE_BUILD_TYPE=Release"]
        if os.environ.get("FASTTRAIN_CUDA_ARCHS"):
            args.append(f"-DFASTTRAIN_CUDA_ARCHS={os.environ['FASTTRAIN_CUDA_ARCHS']}")
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            args += ["-G", "Ninja"]
        cmake = os.environ.get("CMAKE", "cmake")
        log = build_dir / "build.log"
        with open(log, "w") as f:
            for cmd in ([cmake, "-S", str(ROOT), "-B", str(build_dir), *args],
                        [cmake, "--build", str(build_dir), "-j", str(os.cpu_count() or 1)]):
                f.write("$ " + " ".join(cmd) + "\n")
                f.flush()
                if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                    return f"{_first_error(log.read_text())} (log: {log})"
        return None


def _first_error(text: str) -> str:
    """The first error of a CMake or compiler log, as one line ("CMake Error at f (message):" is
    followed by its message on the next lines)."""
    lines = [ln.strip() for ln in text.splitlines()]
    for i, ln in enumerate(lines):
        if "error" in ln.lower():
            if ln.endswith("(message):"):
                follow = next((x for x in lines[i + 1:] if x), "")
                return f"CMake Error: {follow}"
            return ln
    return "CMake failed"


setup(
    name="fasttrain",
    version="0.3.0",
    description="Fast diffusion-model training: fused per-step diffusion math and timestep strategies",
    python_requires=">=3.10",
    # every package under fasttrain/, found rather than listed (a hand-kept list once left three out of
    # non-editable installs), and kernels/ installed as fasttrain.kernels
    packages=find_packages(include=["fasttrain", "fasttrain.*"]) + ["fasttrain.kernels"],
    package_dir={"fasttrain.kernels": "kernels"},
    ext_modules=[Extension("fasttrain._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    package_data={"fasttrain": ["presets/*.yaml", "assets/*.pt"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["fasttrain=fasttrain.cli:main"]},
)
