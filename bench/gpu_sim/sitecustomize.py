"""Loaded at start-up by every Python process of the GPU check's dry run (bench/gpu_plan.py puts this
folder first on PYTHONPATH): the lent GPU machine's import rules (bench/gpu_machine.py, `Guard`), with
the wheelhouse installed at FASTTRAIN_GPU_SITE and the imports logged to FASTTRAIN_GPU_SIM_LOG."""
import importlib.util
import os
import sys

_spec = importlib.util.spec_from_file_location(
    "gpu_machine", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu_machine.py"))
_machine = importlib.util.module_from_spec(_spec)
sys.modules["gpu_machine"] = _machine  # one module object, also for bench scripts that import it
_spec.loader.exec_module(_machine)
_machine.install(os.environ.get("FASTTRAIN_GPU_SITE"), os.environ.get("FASTTRAIN_GPU_SIM_LOG"))
