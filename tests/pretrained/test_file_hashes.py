"""The cached sha256 of model files (file_hashes.py): equal to hashing the bytes directly, remembered by
path, size and mtime (a touched file is hashed again), and a cache that cannot be read or written changes
nothing but the time."""
import hashlib
import json
import os

import pytest

from fasttrain.pretrained import file_hashes


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "sha256.json"


def _files(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.bin"
    a.write_bytes(os.urandom(3 * 1000 + 7))
    b.write_bytes(os.urandom(1000))
    return [a, b]


def test_digests_equal_hashlib_with_and_without_names(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(file_hashes, "BLOCK", 1000)  # several blocks per file
    files = _files(tmp_path)
    plain = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    named = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()
    assert file_hashes.sha256(files) == plain
    assert file_hashes.sha256(files, names=True) == named
    assert file_hashes.sha256(files) == plain and file_hashes.sha256(files, names=True) == named  # from the cache
    assert len(json.loads(cache.read_text())) == 2


def test_the_cache_answers_by_path_size_and_mtime_and_a_touched_file_is_hashed_again(tmp_path, cache):
    f = _files(tmp_path)[:1]
    first = file_hashes.sha256(f)
    st = f[0].stat()
    data = bytearray(f[0].read_bytes())
    data[0] ^= 0xFF  # same size; mtime restored: the cache (as git's index) takes the file as unchanged
    f[0].write_bytes(bytes(data))
    os.utime(f[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_hashes.sha256(f) == first
    os.utime(f[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched: read again
    assert file_hashes.sha256(f) == hashlib.sha256(bytes(data)).hexdigest() != first


def test_an_unusable_cache_changes_nothing_but_the_time(tmp_path, cache, monkeypatch):
    files = _files(tmp_path)
    want = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")  # corrupt: ignored, then replaced
    assert file_hashes.sha256(files) == want
    assert list(json.loads(cache.read_text()).values()) == [want]
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")
    monkeypatch.setenv("FASTTRAIN_CACHE", str(blocked))  # cannot be created: computed every time
    assert file_hashes.sha256(files) == want
