"""diffusers' SDXL timestep bias (`examples/text_to_image/train_text_to_image_sdxl.py`,
`generate_timestep_weights`; flags `--timestep_bias_{strategy,multiplier,portion,begin,end}`) as a sampler.

The source's table over t = 0..T-1 (1 = least noise first), then normalised to sum 1:

    w = ones(T);  k = int(portion·T)                      (Python truncation of the float product)
    earlier:  w[:k]        *= multiplier                  the k least noisy steps
    later:    w[-k:]       *= multiplier                  the k noisiest steps
    range:    w[begin:end] *= multiplier                  end EXCLUSIVE (the source's help text says
                                                          inclusive; its slice is not); portion is ignored
    none:     w unchanged                                 (the source then draws randint(0, T): uniform)

diffusers draws `torch.multinomial(w, B, replacement=True)` every step; that is the same distribution as the
inverse-CDF draw here (`samplers._draw_table`: on the device, no host sync). Biased: iw = 1 (the bias
changes the objective on purpose). `probs()` is the normalised table itself.

Where the source misbehaves, this refuses the value in one line instead of reproducing it:
  * multiplier <= 0: the source `return`s a ValueError object instead of raising it, so training fails
    later inside multinomial;
  * earlier/later with portion·T < 1 (k = 0): `later` slices w[-0:] = all steps and `earlier` w[:0] = none,
    so both silently train uniformly; also a portion outside (0, 1] (a negative k slices from the other end);
  * range with begin >= end: an empty slice, silently uniform. (begin < 0 or end > T the source refuses too.)
`end` defaults to 1000 as in the source, so a range on a schedule with T < 1000 needs an explicit end.
"""
from __future__ import annotations

import torch

from ..errors import InvalidInput
from .samplers import TimestepSampler, _draw_table, register

STRATEGIES = ("none", "earlier", "later", "range")


def timestep_bias_weights(T: int, strategy: str = "none", multiplier: float = 1.0, portion: float = 0.25,
                          begin: int = 0, end: int = 1000) -> torch.Tensor:
    """The source's normalised table, float64 [T]; InvalidInput for the values it mishandles (module docstring)."""
    if strategy not in STRATEGIES:
        raise InvalidInput(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    w = torch.ones(T, dtype=torch.float64)
    if strategy == "none":
        return w / T
    if not multiplier > 0:
        raise InvalidInput(f"multiplier must be > 0 (a factor on the biased steps' probability), got {multiplier!r}")
    if strategy == "range":
        if not 0 <= begin < end <= T:
            raise InvalidInput(f"range needs 0 <= begin < end <= T={T} (end exclusive), got begin={begin!r}, "
                               f"end={end!r}")
        idx = slice(begin, end)
    else:
        k = int(portion * T)  # the source's truncation, float product included
        if not (0 < portion <= 1 and k >= 1):
            raise InvalidInput(f"portion must lie in (0, 1] with int(portion·T) >= 1 step to bias (T={T}), "
                               f"got {portion!r}")
        idx = slice(0, k) if strategy == "earlier" else slice(-k, None)
    w[idx] *= float(multiplier)
    return w / w.sum()


@register("timestep_bias")
class TimestepBias(TimestepSampler):
    """diffusers SDXL `--timestep_bias_*` (module docstring): a fixed table drawn by inverse CDF."""

    def __init__(self, schedule, strategy: str = "none", multiplier: float = 1.0, portion: float = 0.25,
                 begin: int = 0, end: int = 1000):
        super().__init__(schedule)
        self.p = timestep_bias_weights(self.T, strategy, multiplier, portion, begin, end).to(self.device)
        self.cdf = torch.cumsum(self.p, 0)

    def _draw(self, n, generator):
        return _draw_table(self.cdf, n, generator, self.device)

    def probs(self, n=None):
        return self.p.clone()
