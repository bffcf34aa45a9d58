"""Old import paths keep working (docs/architecture.md, "Old paths"): the modules that moved into packages in
0.3 are found under their old names as the same module objects (fasttrain/__init__.py's finder), the old
single modules that became packages (export, parallel, optim, generation, cli) still hand out their names,
and nothing a run records names a module path (checkpoints are weights_only data; DCP metadata admits
torch's classes only), so no checkpoint or config needs its paths mapped."""
from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fasttrain

FIXTURES = Path(__file__).parent / "fixtures" / "main-0a93d06"
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


def test_old_paths_work_in_a_fresh_interpreter_before_any_new_one_is_imported():
    code = ("import fasttrain.vae as a, fasttrain.ema, fasttrain.graphs; from fasttrain.lora import apply\n"
            "import fasttrain.pretrained.vae as b, fasttrain.pretrained.lora as l, fasttrain.optim.ema as e\n"
            "assert a is b and apply is l.apply and fasttrain.ema is e\n"
            "from fasttrain.export_sd import export_text\n"
            "from fasttrain.export.stable_diffusion import export_text as t\n"
            "assert export_text is t; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


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
