"""Imported first by every benchmark script (before torch): OpenMP's wait policy must be in the
environment when torch loads libgomp (fasttrain/parallel/cpu.py), so that a benchmark on a shared machine is
not slowed by threads spinning against another process.

Also what the scripts share so that a run never damages the committed results in bench/results/:
argument types that refuse, in one line, what would measure nothing (zero or negative counts,
unknown names), and `Results`, which writes a run's files only once the run is complete: each file
to a hidden temporary name beside it, then all renamed into place at the end (a failure or an
interrupt before that leaves the committed files as they were).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fasttrain.parallel.cpu import prepare_openmp

prepare_openmp()

# FASTTRAIN_BENCH_RESULTS: another folder for every script's result files (bench/gpu_plan.py's dry run
# writes there, so that a run on tiny shapes never replaces a committed table)
RESULTS = Path(os.environ.get("FASTTRAIN_BENCH_RESULTS") or Path(__file__).parent / "results")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), as fasttrain's command line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def count(minimum: int = 1):
    """An argparse type: an integer >= `minimum` ("--rounds 0" would run nothing and write an empty table)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        return v

    parse.__name__ = "count"  # argparse names the type in its messages
    return parse


def names(known, what: str = "name"):
    """An argparse type: a comma-separated list of known names, each at most once."""
    known = tuple(known)

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in known]
        if bad or not items:
            said = f"unknown {what} {bad[0]!r}" if bad else f"no {what} given"
            raise argparse.ArgumentTypeError(f"{said} (choose from {', '.join(known)})")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"a {what} is given twice in {text!r}")
        return items

    parse.__name__ = what
    return parse


def counts(minimum: int = 1):
    """An argparse type: a comma-separated list of integers >= `minimum` (sizes, dimensions)."""
    one = count(minimum)

    def parse(text: str) -> list[int]:
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"no number given in {text!r}")
        return [one(t) for t in items]

    parse.__name__ = "counts"
    return parse


def stem(text: str) -> str:
    """An argparse type: the name a script's result files start with (inside bench/results/)."""
    if not text or "/" in text or os.sep in text or text.startswith(".") or Path(text).suffix in (".json", ".md"):
        raise argparse.ArgumentTypeError(f"must be a plain file-name stem such as 'adaptive-digits' (the files go to "
                                         f"{RESULTS}/STEM-...), got {text!r}")
    return text


def run(main, *args) -> None:
    """Run a script's `main`; a user error of fasttrain's (a bad config key the arguments made, a folder
    that is not there) ends in one line, as on fasttrain's command line."""
    from fasttrain.errors import UserError

    try:
        main(*args)
    except UserError as e:
        raise SystemExit(f"{Path(sys.argv[0]).name}: error: {str(e).strip().splitlines()[0]}") from None


class Results:
    """The result files of one complete run, put in place together at the end.

        with Results() as res:
            plot(res.path("x-cpu.png"))               # a file a library writes
            res.text("x-cpu.json", json.dumps(out))   # a file written here
        # leaving the block normally renames every file into place; an exception removes them
    """

    def __init__(self, folder: str | Path | None = None):
        self.folder = Path(folder if folder is not None else RESULTS)
        self.staged: dict[Path, Path] = {}

    def path(self, name: str) -> Path:
        """Where to write `name` now (a hidden name with the same suffix: plotting libraries read the
        format from it)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / name
        tmp = final.with_name(f".{final.stem}.{os.getpid()}.tmp{final.suffix}")
        self.staged[final] = tmp
        return tmp

    def text(self, name: str, text: str) -> None:
        self.path(name).write_text(text)

    def __enter__(self) -> Results:
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if kind is None:
            missing = [str(t) for t in self.staged.values() if not t.is_file()]
            if missing:
                self.discard()
                raise RuntimeError(f"result files were not written: {', '.join(missing)}")
            for final, tmp in self.staged.items():
                os.replace(tmp, final)
        else:
            self.discard()
        return False

    def discard(self) -> None:
        for tmp in self.staged.values():
            tmp.unlink(missing_ok=True)
