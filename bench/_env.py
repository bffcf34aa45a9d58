"""Imported first by every benchmark script (before torch): OpenMP's wait policy must be in the
environment when torch loads libgomp (fasttrain/cpu.py), so that a benchmark on a shared machine is
not slowed by threads spinning against another process."""
from fasttrain.cpu import prepare_openmp

prepare_openmp()
