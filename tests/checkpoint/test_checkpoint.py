"""Checkpoints are data, never code: malicious and malformed files end in one line, nothing runs."""
import io
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fasttrain import checkpoint as ckpt
from fasttrain.cli import main


class Evil:
    """A pickle payload that runs a shell command when loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _dcp_folder(tmp_path, extra=None):
    folder = tmp_path / "run" / "dcp"
    state = {"model": {"w": torch.randn(3, 4)}, "ema": {"w": torch.randn(3, 4)},
             "extra": ckpt.to_tensor(extra or {"config": {}, "data_spec": {}, "step": 1})}
    dcp.save(state, checkpoint_id=str(folder))
    return folder


def test_malicious_dcp_metadata_is_refused_and_runs_nothing(tmp_path):
    folder = _dcp_folder(tmp_path)
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    with pytest.raises(ckpt.CheckpointError, match="refusing to read .*posix.system|refusing to read .*os.system"):
        ckpt.read_dcp_metadata(folder)
    for argv in (["sample", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "s")],
                 ["eval", "--ckpt", str(folder)], ["report", str(tmp_path / "run")]):
        assert main(argv) == 1, argv
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["report", str(tmp_path / "run")]) == 1
    assert main(["train", f"run_dir={tmp_path / 'run'}", "train.steps=2", "train.progress=false", "--resume"]) == 1
    assert not marker.exists()


def test_dotted_names_through_an_allowed_module_are_refused(tmp_path):
    """Protocol 4 resolves `module.attr.attr`: metadata's own module imports os, so an allow-list of
    whole modules would let `os.system` in."""
    folder = _dcp_folder(tmp_path)
    marker = tmp_path / "pwned-dotted"
    def short(text: str) -> bytes:  # SHORT_BINUNICODE + MEMOIZE
        raw = text.encode()
        return b"\x8c" + bytes([len(raw)]) + raw + b"\x94"

    payload = (b"\x80\x04" + short("torch.distributed.checkpoint.metadata") + short("os.system") + b"\x93\x94"
               + short(f"touch {marker}") + b"\x85\x94R\x94.")  # STACK_GLOBAL, TUPLE1, REDUCE, STOP
    (folder / ".metadata").write_bytes(payload)
    with pytest.raises(ckpt.CheckpointError, match="refusing to read"):
        ckpt.read_dcp_metadata(folder)
    assert main(["sample", "--ckpt", str(folder.parent), "--out", str(tmp_path / "s")]) == 1
    assert not marker.exists()
    import pickletools
    ops = [op.name for op, _, _ in pickletools.genops(payload)]
    assert "STACK_GLOBAL" in ops and "REDUCE" in ops  # the payload is well-formed: it would have run


def test_pickled_entries_inside_dcp_shards_are_refused(tmp_path):
    """DCP loads non-tensor entries with torch.load(weights_only=False): fasttrain stores none and
    its planner refuses them, so a tampered shard cannot run code either."""
    folder = tmp_path / "d"
    marker = tmp_path / "pwned2"
    dcp.save({"extra": Evil(marker)}, checkpoint_id=str(folder))
    assert not marker.exists()
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load_dcp(folder, {"extra": None})
    assert not marker.exists()


def test_the_real_metadata_passes_the_allow_list(tmp_path):
    folder = _dcp_folder(tmp_path, {"config": {"a": 1}, "data_spec": {}, "step": 7})
    assert ckpt.read_dcp_extra(folder)["train"]["step"] == 7
    holder = {"model": {"w": torch.zeros(3, 4)}}
    ckpt.load_dcp(folder, holder)
    assert holder["model"]["w"].abs().sum() > 0


@pytest.mark.parametrize("content", [b"", b"\x00" * 100, b"PK\x03\x04garbage", "pickle", "keyless", "evil"])
def test_malformed_last_pt_is_one_line(tmp_path, capsys, content):
    run = tmp_path / "run"
    run.mkdir()
    marker = tmp_path / "pwned3"
    if content == "pickle":
        torch.save([1, 2, 3], run / "last.pt")
    elif content == "keyless":
        torch.save({"model": {}}, run / "last.pt")
    elif content == "evil":
        buf = io.BytesIO()
        torch.save({"config": Evil(marker)}, buf)
        (run / "last.pt").write_bytes(buf.getvalue())
    else:
        (run / "last.pt").write_bytes(content)
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load_file(run / "last.pt")
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(run), "--out", str(tmp_path / "s")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "last.pt" in err and "weights_only=False" not in err, err
    assert not marker.exists()


def test_latest_and_resolve(tmp_path):
    assert ckpt.latest(tmp_path) is None
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in"):
        ckpt.resolve(tmp_path)
    ckpt.save_file(tmp_path / "last.pt", {"config": {}, "data_spec": {}, "step": 1, "model": {}, "ema": {}})
    assert ckpt.latest(tmp_path) == tmp_path / "last.pt" and ckpt.resolve(tmp_path) == tmp_path / "last.pt"
    assert not list(tmp_path.glob("*.tmp"))  # the temp file is gone


def test_a_dcp_save_killed_mid_swap_loses_nothing(tmp_path, monkeypatch):
    """Killed between moving the previous folder aside and moving the new one in: the previous
    checkpoint still resumes, and the next save puts it back before replacing it."""
    from pathlib import Path

    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: None)  # one process, no group
    run = tmp_path / "run"
    folder = run / "dcp"

    def state(step):
        return {"model": {"w": torch.full((3, 4), float(step))}, "ema": {"w": torch.zeros(3, 4)},
                "extra": ckpt.to_tensor({"config": {}, "data_spec": {}, "step": step})}

    ckpt.save_dcp(folder, state(1), True)
    real, calls = Path.rename, []

    def dying_rename(self, target):
        if self.parent != run:  # DCP's own renames inside the folder
            return real(self, target)
        calls.append(self.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the second signal, between the two renames
        return real(self, target)

    monkeypatch.setattr(Path, "rename", dying_rename)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_dcp(folder, state(2), True)
    monkeypatch.setattr(Path, "rename", real)
    assert calls == ["dcp", "dcp.tmp"] and not folder.exists()
    assert ckpt.read_plain(run)["train"]["step"] == 1
    ckpt.save_dcp(folder, state(3), True)
    assert ckpt.latest(run) == folder and ckpt.read_plain(run)["train"]["step"] == 3
    assert sorted(p.name for p in run.iterdir()) == ["dcp"]
