#!/usr/bin/env bash
# The GPU check: on the lent GPU machine (one H200, Python 3.12 with a CUDA torch, no network), in one call
# of at most 9 minutes, the wheelhouse and the project installed, then the headline figures first, each
# part with its own time limit and its result written as it finishes (bench/gpu_plan.py: the plan).
#
#   bash bench/gpu_check.sh              # the first call (carry wheels/: bench/gpu_wheels.sh fills it here)
#   bash bench/gpu_check.sh --second     # a second call: every part not yet done (--budget SECONDS)
#   bash bench/gpu_check.sh --plan       # the parts, their limits and the sums
#   bash bench/gpu_check.sh --dry-run    # every part on the CPU with tiny shapes (tests/bench/test_gpu_check.py)
#
# The interpreter: $PYTHON, else python3 (on the lent machine, the one that holds torch).
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" bench/gpu_plan.py "$@"
