"""Class 7: the digest cache (pretrained/file_hashes.py). $FASTTRAIN_CACHE pointing to a file, a corrupt or
truncated cache, a folder that cannot be written: digests are still right, one warning names the cache;
two processes writing it at once lose no entries and leave no corrupt file (flock + merge + replace)."""
import hashlib
import json
import os
import subprocess
import sys

import pytest

from fasttrain.pretrained import file_hashes


@pytest.fixture
def blob(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(os.urandom(5000))
    return [f], hashlib.sha256(f.read_bytes()).hexdigest()


@pytest.mark.parametrize("how", ["a file", "cut-off json", "not text", "a wrong digest", "unwritable"])
def test_an_unusable_cache_gives_the_right_digest_and_one_warning(tmp_path, monkeypatch, capsys, blob, how):
    monkeypatch.setattr(file_hashes, "_warned", set())
    files, want = blob
    cache = tmp_path / "cache"
    if how == "a file":
        cache.write_text("not a folder")
    elif how == "unwritable":
        cache = "/proc/fasttrain-cache"  # no process, root included, may create it
    else:
        cache.mkdir()
        text = {"cut-off json": '{"bytes:x": "ab', "not text": None,
                "a wrong digest": json.dumps({file_hashes._key(files, False): "not-a-digest"})}[how]
        if text is None:
            (cache / "sha256.json").write_bytes(b"\xff\xfe\x00garbage")
        else:
            (cache / "sha256.json").write_text(text)
    monkeypatch.setenv("FASTTRAIN_CACHE", str(cache))
    assert file_hashes.sha256(files) == want
    assert file_hashes.sha256(files) == want  # again: still right, and no second warning
    err = capsys.readouterr().err
    if how == "a wrong digest":  # a bad entry is not believed; the good digest replaces it
        assert not err and json.loads((cache / "sha256.json").read_text()) == {file_hashes._key(files, False): want}
        return
    assert err.count("fasttrain: warning: the digest cache") == 1 and str(cache) in err, err
    if how in ("cut-off json", "not text"):  # replaced by a whole file on the first write
        assert json.loads((cache / "sha256.json").read_text()) == {file_hashes._key(files, False): want}
    if how == "a file":
        assert cache.read_text() == "not a folder"  # nothing of the user's replaced


WRITER = """
import os, sys
from pathlib import Path
from fasttrain.pretrained import file_hashes
root, tag, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for i in range(n):
    f = root / f"{tag}-{i}.bin"
    f.write_bytes(os.urandom(64))
    file_hashes.sha256([f])
"""


def test_two_processes_writing_at_once_lose_no_entry(tmp_path):
    env = {**os.environ, "FASTTRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    n = 60
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), tag, str(n)], env=env)
             for tag in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    data = json.loads((tmp_path / "cache" / "sha256.json").read_text())  # whole JSON, never torn
    assert len(data) == 2 * n
    for tag in "ab":
        for i in range(n):
            f = tmp_path / f"{tag}-{i}.bin"
            assert data[file_hashes._key([f], False)] == hashlib.sha256(f.read_bytes()).hexdigest()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".sha256-")]  # no temp file left
