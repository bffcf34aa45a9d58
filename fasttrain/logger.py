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
    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tb"))
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


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
