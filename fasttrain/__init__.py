"""fasttrain: fast diffusion-model training with the timestep as a first-class object."""
import importlib.util as _ilu
import os as _os


def _prepare_triton_env() -> None:
    """Without CUDA, Triton kernels can only run in the interpreter, and TRITON_INTERPRET must be set
    before anything imports triton (triton's own `tl.rand` helpers are jitted at import time).
    Importing torch does not import triton, so checking CUDA here is safe."""
    if _os.environ.get("TRITON_INTERPRET") is not None or _ilu.find_spec("triton") is None:
        return
    try:
        import torch

        if not torch.cuda.is_available():
            _os.environ["TRITON_INTERPRET"] = "1"
    except Exception:  # pragma: no cover - torch missing or broken: nothing to prepare
        pass


_prepare_triton_env()
__version__ = "0.1.0"
