"""`python -m fasttrain.cli ...` and `torchrun -m fasttrain.cli ...`."""
import sys

from . import main

sys.exit(main())
