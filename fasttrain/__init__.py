"""fasttrain: fast diffusion-model training with the timestep as a first-class object.

Importing fasttrain changes no global state: the Triton interpreter is chosen explicitly
(diffusion.backend=interpret, or TRITON_INTERPRET=1 in the environment before triton is imported).
"""
__version__ = "0.2.0"
