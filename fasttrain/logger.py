"""Metrics to JSONL (one object per line, always) and TensorBoard (when installed)."""
from __future__ import annotations

import json
import math
from pathlib import Path


def _plain(v):
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


class MetricLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, purge_step: int | None = None):
        """`purge_step`: a resumed run drops what an interrupted run logged after its checkpoint,
        so metrics.jsonl and TensorBoard hold one series."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if purge_step is not None and path.is_file():
            keep = [r for r in read_jsonl(path) if r.get("step", 0) <= purge_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            tmp.replace(path)
        self.file = open(path, "a", buffering=1)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # TensorBoard purges events at steps >= purge_step; the checkpoint's own step stays
                self.tb = SummaryWriter(str(self.run_dir / "tb"),
                                        purge_step=None if purge_step is None else purge_step + 1)
            except ImportError:  # tensorboard is a dependency, but a broken install must not stop training
                self.tb = None

    def log(self, step: int, **metrics) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_jsonl(path: str | Path, skipped: list | None = None) -> list[dict]:
    """The rows of a metrics file: JSON objects. A line cut short by a crash, or valid JSON that is not
    an object, is skipped; `skipped` (a list) receives (line number, why) for each."""
    rows = []
    with open(path, errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                why = "not valid JSON"
            else:
                if isinstance(row, dict):
                    rows.append(row)
                    continue
                why = f"a JSON {type(row).__name__}, not an object"
            if skipped is not None:
                skipped.append((n, why))
    return rows


def number(row: dict, key: str) -> float | None:
    """row[key] as a finite float, or None (absent, null, or not a number: hand-edited or foreign lines)."""
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)
