"""The command line (`fasttrain train|sample|eval|report|export|data`): `commands.py` (the parser, `train`,
`report`, `export`, `data prepare`), `generate.py` (`sample` and `eval`, split across ranks), `common.py`
(what they share: one-line errors, output paths, the checkpoint's bundle and the folders it reads), `ema.py`
(`fasttrain ema`: post-hoc EMA reconstructions, and `eval --sigma-rel`'s sweep).
`python -m fasttrain.cli` runs it too (`__main__.py`; torchrun's `-m fasttrain.cli`)."""
from .. import _names_of
from ..parallel.cpu import prepare_openmp

prepare_openmp()  # before anything imports torch (parallel/cpu.py): idle OpenMP threads yield on a busy machine


def main(argv: list[str] | None = None) -> int:
    """The `fasttrain` command (setup.py's console script)."""
    from .commands import main as run

    return run(argv)


# `fasttrain.cli` was one module before 0.3 (commands.py now): its names stay reachable here
__getattr__ = _names_of(__name__, "commands")
