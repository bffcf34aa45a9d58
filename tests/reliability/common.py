"""What the hostile-input tests share: the one-line check and the tiny settings."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))

TINY = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1",
        "model.args.ch=8", "diagnostics.interference_every=0"]


def one_line(capsys, *needles, notes: bool = False) -> str:
    """The error is one `fasttrain: error:` line naming each needle; with `notes`, informational lines may
    come before it (never a traceback)."""
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert lines and lines[-1].startswith("fasttrain: error:") and "Traceback" not in err, err
    assert notes or len(lines) == 1, err
    for n in needles:
        assert n in lines[-1], lines[-1]
    return lines[-1]


def files(root) -> list[str]:
    """Every path under `root` (hidden ones too), for 'nothing was written'."""
    root = Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []
