"""The project's one noise stream, in plain PyTorch: ε for (seed, offset + element index).

Exactly the stream of Triton's `tl.randn(seed, offset)` (triton/language/random.py), which the fused
kernels use, so that every backend (Triton, native C++/CUDA, this reference) draws the same ε:

  counter  c = (lo32(offset), hi32(offset), 0, 0), key k = (lo32(seed), hi32(seed))
  Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"): ten rounds of
      c0' = mulhi(B, c2) ^ c1 ^ k0,  c2' = mulhi(A, c0) ^ c3 ^ k1,  c1' = lo(B·c2),  c3' = lo(A·c0)
      k0 += 0x9E3779B9,  k1 += 0xBB67AE85      (A = 0xD2511F53, B = 0xCD9E8D57)
  uniform  u = int32(x) (x bit-cast; negative values complemented) · 4.6566127342e-10   ∈ [0, 1)
  normal   Box–Muller on the first two words: sqrt(-2·ln(max(u1, 1e-7)))·cos(2π·u2)

The uint32 words are bit-identical to Triton's; the normals agree to float32 rounding (log and cos
are the only transcendental steps). Integer arithmetic runs in int64 with 16-bit limbs so that no
product overflows. Cost: ~150 elementwise passes, fine for tests and small CPU batches; the fused
kernels and the native ops are the fast paths.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
SEED_LIMIT = 2**63  # seeds are non-negative 63-bit integers (Triton passes them as int64)


def check_seed(seed: int) -> int:
    seed = int(seed)
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"noise seed must lie in [0, 2**63), got {seed}")
    return seed


def _mulhilo(a: torch.Tensor, const: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi32, lo32) of const·a for uint32 values held in int64, via 16-bit limbs of the constant."""
    ch, cl = const >> 16, const & 0xFFFF
    p, q = a * ch, a * cl  # both < 2**48
    hi = (p + (q >> 16)) >> 16
    lo = (((p & 0xFFFF) << 16) + q) & _M32
    return hi, lo


def philox4x32(seed: int, counter: torch.Tensor, rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Four uint32 words (as int64 tensors) per 64-bit counter value."""
    seed = check_seed(seed)
    counter = counter.to(torch.int64)
    c0, c1 = counter & _M32, (counter >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(c2, ROUND_B)
        hi_a, lo_a = _mulhilo(c0, ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & _M32, (k1 + KEY_B) & _M32
    return c0, c1, c2, c3


def uniform(word: torch.Tensor) -> torch.Tensor:
    """Triton's `uint_to_uniform_float` for 32-bit words: float32 in [0, 1)."""
    x = torch.where(word >= 2**31, word - 2**32, word)  # bit-cast to int32
    x = torch.where(x < 0, -x - 1, x)  # ~x
    return x.to(torch.float32) * 4.6566127342e-10


def normal(seed: int, counter: torch.Tensor) -> torch.Tensor:
    """float32 N(0, 1) per counter value: `tl.randn(seed, counter)`."""
    w0, w1, _, _ = philox4x32(seed, counter)
    u1 = torch.clamp(uniform(w0), min=1e-7)
    th = 6.283185307179586 * uniform(w1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(th)


def randn(shape, seed: int, offset, device="cpu") -> torch.Tensor:
    """ε of a whole batch, `tl.randn` over it: element i (row-major) uses counter offset + i (offset: int
    or 0-d tensor). Named after tl.randn, not "noise": the noise op (noise.py) returns x_t, not ε."""
    n = 1
    for d in shape:
        n *= int(d)
    idx = torch.arange(n, dtype=torch.int64, device=device) + offset
    return normal(seed, idx).view(tuple(shape))
