"""What updates the weights: `adamw.py` (the optimizer, skipping non-finite steps on the device) and
`ema.py` (the EMA of the weights), `phema.py` (post-hoc EMA's power-function profiles, EDM2 §3) and
`posthoc.py` (reconstructing any EMA length from their snapshots)."""


from .. import _names_of

# `fasttrain.optim` was one module before 0.3 (adamw.py now): its names stay reachable here
__getattr__ = _names_of(__name__, "adamw")
