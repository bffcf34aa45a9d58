"""How a run uses its hardware: `wrap.py` (`parallelize`: AC → compile → FSDP2 / DDP), `distributed.py`
(the process group), `precision.py` (fp32 / bf16 / fp16), `graphs.py` (the step as one CUDA graph),
`cpu.py` (CPU threads)."""


def __getattr__(name: str):
    # `fasttrain.parallel` was one module before 0.3 (wrap.py now): its names stay reachable here
    import importlib

    if not name.startswith("__"):
        module = importlib.import_module(f"{__name__}.wrap")
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
