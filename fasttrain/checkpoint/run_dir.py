"""The run directory: one trainer at a time (a lock), and an earlier run moved aside, never overwritten."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import MissingFile, RunDirError
from .formats import latest


class RunLock:
    """One trainer per run directory: an exclusive lock on RUN/.lock for the process's lifetime."""

    def __init__(self, run_dir: str | os.PathLike):
        import fcntl

        self.path = Path(run_dir) / ".lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a+")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._f.close()
            raise RunDirError(f"another fasttrain process is using {self.path.parent} "
                              f"(wait for it or choose another run_dir)") from None
        self._f.seek(0)
        self._f.truncate()
        self._f.write(str(os.getpid()))
        self._f.flush()

    def release(self) -> None:
        import fcntl

        if not self._f.closed:
            fcntl.flock(self._f, fcntl.LOCK_UN)
            self._f.close()


def archive_previous_run(run_dir: str | os.PathLike) -> Path | None:
    """`--restart`: move what an earlier run left (checkpoints, metrics, plots) into
    RUN/previous-<n>/, so a fresh run starts clean and nothing is lost."""
    run_dir = Path(run_dir)
    items = [p for p in run_dir.iterdir() if not p.name.startswith((".", "previous-"))] if run_dir.is_dir() else []
    if not items:
        return None
    n = 1
    while (run_dir / f"previous-{n}").exists():
        n += 1
    dest = run_dir / f"previous-{n}"
    dest.mkdir()
    for p in items:
        p.rename(dest / p.name)
    return dest




def claim(run_dir: str | os.PathLike, resume: bool, restart: bool) -> RunLock:
    """Lock the run directory for this trainer (the main process calls this). A fresh run never
    overwrites an earlier one: it refuses a directory that holds a run unless `restart`, which moves
    the earlier run to RUN/previous-N/; `resume` needs a checkpoint to resume from."""
    import sys

    run_dir = Path(run_dir)
    if resume and latest(run_dir) is None:  # before anything is created there
        raise no_checkpoint(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir)
    if resume:
        return lock
    earlier = [p.name for p in (run_dir / "last.pt", run_dir / "dcp", run_dir / "crash.pt",
                                run_dir / "metrics.jsonl") if p.exists()]
    if earlier and restart:
        moved = archive_previous_run(run_dir)
        print(f"fasttrain: moved the earlier run to {moved}", file=sys.stderr)
    elif earlier:
        lock.release()
        how = ("continue it with --resume, or " if latest(run_dir) else "it has no checkpoint to continue from, so ")
        raise RunDirError(f"{run_dir} already holds a run ({', '.join(earlier)}): {how}start over with --restart "
                          f"(which moves it to {run_dir}/previous-N/)")
    return lock


def no_checkpoint(run_dir: Path) -> MissingFile:
    crash = "; crash.pt holds a failed run's state, not a resumable one: start over with --restart" \
        if (run_dir / "crash.pt").exists() else ""
    return MissingFile(f"--resume: no checkpoint at {run_dir / 'last.pt'} or {run_dir / 'dcp'}{crash}")
