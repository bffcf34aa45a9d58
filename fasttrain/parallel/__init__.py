"""How a run uses its hardware: `wrap.py` (`parallelize`: AC → compile → FSDP2 / DDP), `distributed.py`
(the process group), `precision.py` (fp32 / bf16 / fp16), `graphs.py` (the step as one CUDA graph),
`cpu.py` (CPU threads)."""


from .. import _names_of

# `fasttrain.parallel` was one module before 0.3 (wrap.py now): its names stay reachable here
__getattr__ = _names_of(__name__, "wrap")
