"""The one noise stream (kernels/philox.py): the PyTorch Philox4x32-10 against Python integers, the
full 64-bit seed and offset, and the native op's words against it on every CPU kernel set. The normals
of every backend against it: test_noise.py."""
import pytest
import torch
from harness import backends

from fasttrain.kernels import philox


def _philox_scalar(seed, counter):
    """Philox4x32-10 written out on Python ints (Salmon et al. 2011, Fig. 2)."""
    M = 0xFFFFFFFF
    c = [counter & M, (counter >> 32) & M, 0, 0]
    k = [seed & M, (seed >> 32) & M]
    for _ in range(10):
        pa, pb = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(pb >> 32) ^ c[1] ^ k[0], pb & M, (pa >> 32) ^ c[3] ^ k[1], pa & M]
        k = [(k[0] + 0x9E3779B9) & M, (k[1] + 0xBB67AE85) & M]
    return c


@pytest.mark.parametrize("seed,offset", [(0, 0), (7, 2**32 - 3), (2**40 + 9, 2**33), (2**63 - 1, 5)])
def test_philox_words_against_python_ints(seed, offset):
    idx = torch.arange(6) + offset
    words = philox.philox4x32(seed, idx)
    for i, ctr in enumerate(idx.tolist()):
        assert [w[i].item() for w in words] == _philox_scalar(seed, ctr)


@backends("native", every_cpu_set=True)
@pytest.mark.parametrize("seed, offset", [(0, 0), (11, 12345), (2**40 + 5, 2**32 - 300), (2**63 - 1, 2**63 - 200)])
def test_native_words_are_the_reference_bits(backend, seed, offset):
    """Words 0 and 1 bit for bit, across the 2^32 carry of the counter and with 64-bit seeds."""
    words = torch.ops.fasttrain_C.philox_words(seed, offset, 1037)
    w0, w1, _, _ = philox.philox4x32(seed, torch.arange(1037) + offset)
    assert torch.equal(words[0], w0) and torch.equal(words[1], w1)


def test_philox_uses_the_full_seed_and_offset_width():
    """Seeds s and s + 2**32 (and offsets o and o + 2**32) give different noise."""
    a = philox.randn((1000,), 5, 0)
    assert (a - philox.randn((1000,), 5 + 2**32, 0)).abs().mean() > 0.5
    assert (a - philox.randn((1000,), 5, 2**32)).abs().mean() > 0.5
    assert abs(a.mean().item()) < 0.1 and abs(a.std().item() - 1) < 0.1
    with pytest.raises(ValueError, match="seed must lie in"):
        philox.randn((3,), -1, 0)
