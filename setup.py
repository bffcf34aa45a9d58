"""fasttrain: a diffusion-model trainer that treats the timestep as a first-class object.

`kernels/` is installed as the subpackage `fasttrain.kernels` (a top-level `kernels` would collide
with other packages, see DESIGN.md).
"""
from setuptools import setup

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
]

DALI = ["nvidia-dali-cuda130>=2.0"]  # CPU pipelines work without a GPU (device_id=None)
EXTRAS = {
    "dali": DALI,
    "dev": ["pytest>=8", "pytest-benchmark>=4", "scipy>=1.10"] + DALI,
}

setup(
    name="fasttrain",
    version="0.1.0",
    description="Fast diffusion-model training: fused per-step diffusion math and timestep strategies",
    python_requires=">=3.10",
    packages=[
        "fasttrain",
        "fasttrain.diffusion",
        "fasttrain.models",
        "fasttrain.data",
        "fasttrain.kernels",
    ],
    package_dir={"fasttrain.kernels": "kernels"},
    package_data={"fasttrain": ["presets/*.yaml", "assets/*.pt"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["fasttrain=fasttrain.cli:main"]},
)
