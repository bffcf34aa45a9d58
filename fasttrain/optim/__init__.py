"""What updates the weights: `adamw.py` (the optimizer, skipping non-finite steps on the device) and
`ema.py` (the EMA of the weights), `phema.py` (post-hoc EMA's power-function profiles, EDM2 §3) and
`posthoc.py` (reconstructing any EMA length from their snapshots)."""


def __getattr__(name: str):
    # `fasttrain.optim` was one module before 0.3 (adamw.py now): its names stay reachable here
    import importlib

    if not name.startswith("__"):
        module = importlib.import_module(f"{__name__}.adamw")
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
