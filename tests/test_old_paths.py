"""Old import paths keep working (docs/architecture.md, "Old import paths and checkpoints"): the modules that
moved into packages in 0.3 are found under their old names as the same module objects (fasttrain/__init__.py's
finder), the old single modules that became packages (export, parallel, optim, generation, cli) still hand
out their names, every function and class a 0.2 module defined is found under its old path (but the few
MOVED_NAMES), an object pickled under a 0.2 module path unpickles, and nothing a run records names a module
path (checkpoints are weights_only data; DCP metadata admits torch's classes only), so no checkpoint or
config needs its paths mapped."""
from __future__ import annotations

import importlib
import inspect
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fasttrain

FIXTURES = Path(__file__).parent / "fixtures" / "main-0a93d06"
# the public functions and classes each module of 0.2 defined (tests/fixtures/make_old_names.py wrote it)
OLD_NAMES = json.loads((Path(__file__).parent / "fixtures" / "names-0.2.json").read_text())
# 0.2 names that 0.3 moved to a module their old one cannot import without an import circle
# (tests/test_layout.py), or took out: the old path → the new one (None: no longer exists, and why)
MOVED_NAMES = {
    "fasttrain.diffusion.lookahead.reference_step": "fasttrain.step.reference_step",  # it runs the step
    "fasttrain.kernels.noise_spec.prepare": "fasttrain.kernels.noise_prepare.prepare",  # it runs noise_std
    "fasttrain.periodic.RunView": "fasttrain.periodic.ActionParts",  # a view of the run's parts, not the trainer
    "fasttrain.data.kinds.DataArgs": None,  # the positional copy of the data fields: a kind reads cfg.data itself
    # the AOT check tool's vocabulary, which the Triton modules are given without importing the tool
    **{f"fasttrain.kernels.aot.{n}": f"fasttrain.kernels.aot_specs.{n}" for n in ("loss_table", "name", "noise_spec",
                                                                                 "unaligned")},
}
# old single modules that are packages now → the module that holds what they held
BECAME_PACKAGES = {"fasttrain.export": "fasttrain.export.dispatch", "fasttrain.parallel": "fasttrain.parallel.wrap",
                   "fasttrain.optim": "fasttrain.optim.adamw", "fasttrain.generation": "fasttrain.generation.ranks",
                   "fasttrain.cli": "fasttrain.cli.commands"}


@pytest.mark.parametrize("old, new", sorted(fasttrain._MOVED.items()))
def test_a_moved_module_is_the_same_object_under_its_old_name(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    assert getattr(fasttrain, old.split(".", 1)[1]) is importlib.import_module(new)


@pytest.mark.parametrize("old, new", sorted(BECAME_PACKAGES.items()))
def test_an_old_module_that_became_a_package_still_hands_out_its_names(old, new):
    package, module = importlib.import_module(old), importlib.import_module(new)
    own = [n for n, v in vars(module).items() if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
           and v.__module__ == new]
    assert len(own) >= 1
    for name in own:
        if name in vars(package):  # the package's own (cli.main: the console entry, calling commands.main)
            assert callable(vars(package)[name])
            continue
        assert getattr(package, name) is getattr(module, name), name
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018


def test_the_names_old_code_imports_most_are_the_new_objects():
    from fasttrain.export import export_diffusers, written_whole
    from fasttrain.export.common import written_whole as whole
    from fasttrain.export.dispatch import export_diffusers as dispatch_export
    from fasttrain.optim import make_optimizer
    from fasttrain.optim.adamw import make_optimizer as adamw
    from fasttrain.parallel import parallelize
    from fasttrain.parallel.wrap import parallelize as wrap

    assert (export_diffusers, written_whole, make_optimizer, parallelize) == (dispatch_export, whole, adamw, wrap)


def _resolve(dotted: str):
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def test_every_name_a_0_2_module_defined_is_found_under_its_old_path():
    """What 0.2 code imported (`from fasttrain.export import written_whole`, `from fasttrain.bundle import
    DataSpec`, `from fasttrain.parallel import parallelize`, ...) is the object its module holds today."""
    assert OLD_NAMES["commit"] == "3ca2b7d" and sum(map(len, OLD_NAMES["modules"].values())) > 500
    found, missing = 0, []
    for module, names in sorted(OLD_NAMES["modules"].items()):
        for name in names:
            old = f"{module}.{name}"
            if old in MOVED_NAMES:
                with pytest.raises(AttributeError):
                    _resolve(old)
                continue
            try:
                value = _resolve(old)
            except (ImportError, AttributeError) as e:
                missing.append(f"{old} ({type(e).__name__})")
                continue
            if inspect.isclass(value) or inspect.isfunction(value):  # the object the module defining it holds now
                home = importlib.import_module(value.__module__)
                assert value.__module__.startswith("fasttrain.") and getattr(home, value.__name__) is value, old
            found += 1
    assert not missing, f"0.2 names no longer found under their old paths: {missing}"
    assert found > 500
    for new in MOVED_NAMES.values():
        if new is not None:
            assert callable(_resolve(new)), new


def _pickled_by_0_2(obj, new: str, old: str) -> bytes:
    """`obj` pickled as 0.2 code pickled it: its class named by its 0.2 module (protocol 2 names a global as
    `module\\nname\\n`, so the module's name can be put back)."""
    data = pickle.dumps(obj, protocol=2)
    assert f"{new}\n".encode() in data
    return data.replace(f"{new}\n".encode(), f"{old}\n".encode())


def test_an_object_pickled_under_a_0_2_module_path_unpickles():
    """Pickles name a class by its module (torch.save of a whole object, weights_only=False): an object a 0.2
    run pickled from fasttrain.bundle, fasttrain.export or fasttrain.generation loads as today's class."""
    from fasttrain.data.spec import DataSpec
    from fasttrain.export.dispatch import PipelineKind
    from fasttrain.generation.ranks import SampleSettings

    spec = DataSpec("digits", 1, 8, 10, 0.1, class_names=list("0123456789"))
    back = pickle.loads(_pickled_by_0_2(spec, "fasttrain.data.spec", "fasttrain.bundle"))
    assert type(back) is DataSpec and back == spec
    for cls, new, old in ((PipelineKind, "fasttrain.export.dispatch", "fasttrain.export"),
                          (SampleSettings, "fasttrain.generation.ranks", "fasttrain.generation")):
        assert pickle.loads(_pickled_by_0_2(cls, new, old)) is cls
    from fasttrain.optim.ema import EMA

    assert pickle.loads(_pickled_by_0_2(EMA, "fasttrain.optim.ema", "fasttrain.ema")) is EMA


def test_old_paths_work_in_a_fresh_interpreter_before_any_new_one_is_imported():
    code = ("import fasttrain.vae as a, fasttrain.ema, fasttrain.graphs; from fasttrain.lora import apply\n"
            "import fasttrain.pretrained.vae as b, fasttrain.pretrained.lora as l, fasttrain.optim.ema as e\n"
            "assert a is b and apply is l.apply and fasttrain.ema is e\n"
            "from fasttrain.export_sd import export_text\n"
            "from fasttrain.export.stable_diffusion import export_text as t\n"
            "assert export_text is t; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_every_moved_module_imports_first_under_its_old_name_in_a_fresh_interpreter():
    code = ("import importlib, sys, fasttrain\n"
            "for old, new in sorted(fasttrain._MOVED.items()):\n"
            "    m = importlib.import_module(old)\n"
            "    assert m is sys.modules[new] is sys.modules[old] and m.__name__ == new, old\n"
            "print(len(fasttrain._MOVED))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == str(len(fasttrain._MOVED)), out.stderr[-2000:]


def test_checkpoints_record_no_module_path():
    """The checkpoints of every earlier format the project keeps load with weights_only=True: no pickled
    class, so no module path that a move could break; their recorded config and data spec are plain data."""
    files = sorted(FIXTURES.glob("*/last.pt"))
    assert len(files) >= 2
    for f in files:
        state = torch.load(f, weights_only=True)
        assert isinstance(state["config"], dict) and isinstance(state["data_spec"], dict)
        text = repr({k: v for k, v in state.items() if k in ("config", "data_spec")})
        assert "fasttrain." not in text, f
