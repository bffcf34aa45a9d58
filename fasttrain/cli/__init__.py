"""The command line (`fasttrain train|sample|eval|report|export|data`): `commands.py` holds the parser and
the commands, `generate.py` the `sample` and `eval` commands. `python -m fasttrain.cli` runs it too
(torchrun's `-m fasttrain.cli`)."""
from ..parallel.cpu import prepare_openmp

prepare_openmp()  # before anything imports torch (parallel/cpu.py): idle OpenMP threads yield on a busy machine


def main(argv: list[str] | None = None) -> int:
    """The `fasttrain` command (setup.py's console script)."""
    from .commands import main as run

    return run(argv)
