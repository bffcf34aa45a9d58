"""What every figure shares: matplotlib on its file-only backend, and the one way a figure is saved."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on training machines (before pyplot is imported)
import matplotlib.pyplot as plt
import numpy as np
import torch

__all__ = ["finish", "plt", "to_numpy"]


def finish(fig, path, title: str = "") -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def to_numpy(x) -> np.ndarray:
    return x.detach().double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=float)
