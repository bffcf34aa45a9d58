"""The package installs whole: built non-editably (setup.py's own build_py, what a wheel or `pip install .`
puts into site-packages, with the compiled `_C` where this checkout has one), and imported with only that
build and the third-party packages on the path (no editable finder, not the source tree), every module
imports, and a 5-step training run, a sample and an export work. A package left out of setup.py, or a
preset, an asset or the exported pipeline file missing from the package data, fails here."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import sys
    build, run, out = sys.argv[1], sys.argv[2], sys.argv[3]
    import importlib, pkgutil
    from pathlib import Path
    import fasttrain
    assert Path(fasttrain.__file__).resolve().is_relative_to(Path(build).resolve()), fasttrain.__file__
    assert not any("editable" in repr(f) for f in sys.meta_path), sys.meta_path
    names = [m.name for m in pkgutil.walk_packages(fasttrain.__path__, "fasttrain.")]
    for name in names:
        if not name.endswith("__main__"):  # it runs the command line
            importlib.import_module(name)
    print("modules", len(names))
    for name in names:
        assert Path(sys.modules.get(name, fasttrain).__file__).resolve().is_relative_to(Path(build).resolve()), name
    from fasttrain.cli import main
    tiny = ["train.steps=5", "train.log_every=5", "train.ckpt_every=5", "model.args.ch=8", "train.progress=false",
            "sample.num=4", "sample.steps=3", "eval.num_samples=0", "eval.bpd=false", "train.plots=false",
            "diagnostics.interference_every=0", "train.threads=1"]
    assert main(["train", f"run_dir={run}", *tiny]) == 0                      # the default preset (package data)
    assert main(["sample", "--ckpt", run, "--n", "4", "--steps", "3", "--out", out + "/samples"]) == 0
    assert main(["export", run, "--to", "diffusers", out + "/pipe"]) == 0    # ships remote_pipeline.py
    assert (Path(out) / "pipe" / "pipeline.py").is_file()
    print("ok")
""")


def _third_party_paths() -> list[str]:
    """The site-packages folders the test's interpreter reads (its own and those its .pth files add), which the
    child is given by hand: it starts without `site`, so no .pth file (an editable finder) is run."""
    return [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]


def test_a_non_editable_build_imports_every_module_and_trains_samples_and_exports(tmp_path):
    build = tmp_path / "build"
    env = {**os.environ, "FASTTRAIN_NATIVE": "0"}
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for native in (ROOT / "fasttrain").glob("_C*.so"):  # the extension the install builds (CMake), where it was
        shutil.copy(native, build / "fasttrain")
    pkg = build / "fasttrain"
    for rel in ("presets/default.yaml", "assets/digits_mlp.pt", "export/remote_pipeline.py", "kernels/noise.py",
                "periodic/checkpoint.py", "checkpoint/formats.py", "plots/run.py"):
        assert (pkg / rel).is_file(), rel
    prelude = f"import sys; sys.path[:0] = {[str(build), *_third_party_paths()]!r}\n"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    out = subprocess.run([sys.executable, "-S", "-c", prelude + CHILD, str(build), str(tmp_path / "run"),
                          str(tmp_path / "out")], cwd=tmp_path, env=child_env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")
    n = int(next(line for line in out.stdout.splitlines() if line.startswith("modules")).split()[1])
    assert n > 120  # every module of fasttrain and fasttrain.kernels was found in the build
    assert (tmp_path / "run" / "last.pt").is_file() and len(list((tmp_path / "out" / "samples").glob("0*.png"))) == 4
