"""fasttrain: fast diffusion-model training with the timestep as a first-class object.

Importing fasttrain changes no global state beyond a finder for its own moved module names (below): the
Triton interpreter is chosen explicitly (diffusion.backend=interpret, or TRITON_INTERPRET=1 in the
environment before triton is imported).
"""
__version__ = "0.3.0"

# Modules that moved into packages in 0.3 (docs/architecture.md, "Packages"): the old import paths keep
# working, each the same module object as its new path.
_MOVED = {
    "fasttrain.cli_generate": "fasttrain.cli.generate",
    "fasttrain.convert": "fasttrain.export.convert",
    "fasttrain.export_pipeline": "fasttrain.export.remote_pipeline",
    "fasttrain.export_sd": "fasttrain.export.stable_diffusion",
    "fasttrain.export_sd3": "fasttrain.export.sd3",
    "fasttrain.model_card": "fasttrain.export.model_card",
    "fasttrain.scheduler_config": "fasttrain.pretrained.scheduler_config",
    "fasttrain.vae": "fasttrain.pretrained.vae",
    "fasttrain.text_encoders": "fasttrain.pretrained.text_encoders",
    "fasttrain.lora": "fasttrain.pretrained.lora",
    "fasttrain.model_folders": "fasttrain.pretrained.model_folders",
    "fasttrain.file_hashes": "fasttrain.pretrained.file_hashes",
    "fasttrain.evaluate": "fasttrain.generation.evaluate",
    "fasttrain.features": "fasttrain.generation.features",
    "fasttrain.feature_stats": "fasttrain.generation.feature_stats",
    "fasttrain.report": "fasttrain.generation.report",
    "fasttrain.distributed": "fasttrain.parallel.distributed",
    "fasttrain.cpu": "fasttrain.parallel.cpu",
    "fasttrain.precision": "fasttrain.parallel.precision",
    "fasttrain.graphs": "fasttrain.parallel.graphs",
    "fasttrain.ema": "fasttrain.optim.ema",
}


class _MovedFinder:
    """Finds a moved module under its old name and hands back the module at its new path."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in _MOVED:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(name, _MovedFinder)

    @staticmethod
    def create_module(spec):
        import importlib

        return importlib.import_module(_MOVED[spec.name])

    @staticmethod
    def exec_module(module):
        pass


def __getattr__(name: str):
    if f"{__name__}.{name}" in _MOVED:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _names_of(package: str, module: str):
    """`package`'s __getattr__ for a package that was one module before 0.3 (cli, export, generation, optim,
    parallel): a name it does not define is looked up in `module`, the file that took the old module's code."""
    def getattr_(name: str):
        import importlib

        if not name.startswith("__"):
            found = importlib.import_module(f"{package}.{module}")
            if hasattr(found, name):
                return getattr(found, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return getattr_


import sys as _sys  # noqa: E402

_sys.meta_path.append(_MovedFinder)
