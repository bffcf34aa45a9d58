"""Checkpoints: one torch.save file per save, written atomically (temp file + rename) so a crash
mid-write never leaves a truncated `last.pt`. Loaded with `weights_only=True` (tensors, numbers,
strings and containers only)."""
from __future__ import annotations

import io
import os
from pathlib import Path

import torch


def save(path: str | os.PathLike, state: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load(path: str | os.PathLike, map_location="cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, map_location=map_location, weights_only=True)


def to_bytes(obj) -> bytes:
    """Small non-tensor state (schedules, samplers, RNGs, positions) as one blob for DCP checkpoints."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(blob: bytes):
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
