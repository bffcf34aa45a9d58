"""Checkpoints: the formats and reading them safely (formats.py), the run directory and its lock
(run_dir.py), the manager that saves and restores a trainer's named components (manager.py), and the
post-hoc EMA snapshots in RUN/phema/ (snapshots.py)."""
from ..errors import CheckpointError
from .formats import (
                      FORMAT,
                      from_tensor,
                      latest,
                      load_dcp,
                      load_file,
                      load_weights,
                      read_bundle_state,
                      read_dcp_extra,
                      read_dcp_metadata,
                      read_plain,
                      resolve,
                      save_dcp,
                      save_file,
                      to_tensor,
                      train_state,
)
from .manager import CheckpointManager, config_diff
from .run_dir import RunLock, archive_previous_run, claim, no_checkpoint

__all__ = ["FORMAT", "CheckpointError", "CheckpointManager", "RunLock", "archive_previous_run", "claim",
           "config_diff", "from_tensor", "latest", "load_dcp", "load_file", "load_weights", "no_checkpoint",
           "read_bundle_state", "read_dcp_extra", "read_dcp_metadata", "read_plain", "resolve", "save_dcp",
           "save_file", "to_tensor", "train_state"]
