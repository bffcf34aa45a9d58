"""The `timestep_bias` sampler against diffusers' SDXL `generate_timestep_weights`, rebuilt here as the source
writes it (float32 table, Python slices), its draws against the source's `multinomial` draws, and the
values where the source misbehaves refused in one line. (Its histogram against probs(): test_samplers.py.)"""
import pytest
import torch
from test_samplers import chi2_pvalue

from fasttrain import diffusion as fd
from fasttrain.errors import InvalidInput


def source_weights(T, strategy, multiplier=1.0, portion=0.25, begin=0, end=1000):
    """generate_timestep_weights for the values it handles: ones, a slice times the multiplier, normalised."""
    w = torch.ones(T)  # float32, as the source
    k = int(portion * T)
    idx = {"later": slice(-k, None), "earlier": slice(0, k), "range": slice(begin, end)}[strategy]
    w[idx] *= multiplier
    return w / w.sum()


CASES = [
    (1000, "later", {"multiplier": 2.0, "portion": 0.25}),
    (1000, "earlier", {"multiplier": 5.0, "portion": 0.1}),
    (1000, "earlier", {"multiplier": 0.2, "portion": 0.29}),  # 0.29·1000 = 290.00000000000006 → 290
    (100, "later", {"multiplier": 3.0, "portion": 0.57}),     # 0.57·100 = 56.99999999999999 → 56, not 57
    (1000, "range", {"multiplier": 4.0, "begin": 200, "end": 500}),
    (1000, "range", {"multiplier": 0.5, "begin": 0, "end": 1000, "portion": 0.0}),  # portion ignored
    (50, "later", {"multiplier": 7.0, "portion": 1.0}),  # every step: uniform again
]


@pytest.mark.parametrize("T,strategy,args", CASES)
def test_probs_equal_the_source_table(T, strategy, args):
    s = fd.schedule("linear", T=T)
    p = fd.timestep_sampler("timestep_bias", s, strategy=strategy, **args).probs()
    assert p.dtype == torch.float64 and p.sum().item() == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(p, source_weights(T, strategy, **args).double(), rtol=1e-6, atol=0)


def test_exact_values_truncation_and_the_end_exclusive_range():
    lin = fd.schedule("linear", T=1000)
    p = fd.timestep_sampler("timestep_bias", lin, strategy="later", multiplier=2.0, portion=0.25).probs()
    assert (p[:750] == 1 / 1250).all() and (p[750:] == 2 / 1250).all()  # 750·1 + 250·2 = 1250
    p = fd.timestep_sampler("timestep_bias", lin, strategy="range", multiplier=4.0, begin=200, end=500).probs()
    assert p[199].item() == p[500].item() == pytest.approx(1 / 1900) and p[200].item() == p[499].item() == 4 / 1900
    p = fd.timestep_sampler("timestep_bias", fd.schedule("linear", T=100), strategy="later", multiplier=3.0,
                            portion=0.57).probs()
    assert int((p > p.min()).sum()) == 56 and (p[44:] > p[0]).all()
    none = fd.timestep_sampler("timestep_bias", lin).probs()
    assert (none == 1 / 1000).all()


@pytest.mark.parametrize("T,strategy,args", CASES[:5])
def test_draws_match_the_sources_multinomial_draws(T, strategy, args):
    """The inverse-CDF draw and the source's `multinomial(w, B, replacement=True)` both fit probs()."""
    smp = fd.timestep_sampler("timestep_bias", fd.schedule("linear", T=T), strategy=strategy, **args)
    g = torch.Generator().manual_seed(11)
    ours = torch.cat([smp.sample(1000, g)[0] for _ in range(100)])
    theirs = torch.multinomial(source_weights(T, strategy, **args), 100_000, replacement=True, generator=g)
    assert chi2_pvalue(ours, smp.probs()) > 1e-3 and chi2_pvalue(theirs, smp.probs()) > 1e-3
    _, iw = smp.sample(7, g)
    assert (iw == 1).all() and smp.biased


def test_the_check_has_power():
    """Draws with the range one step longer (end inclusive, as the source's help text says) are rejected."""
    lin = fd.schedule("linear", T=1000)
    smp = fd.timestep_sampler("timestep_bias", lin, strategy="range", multiplier=20.0, begin=600, end=601)
    g = torch.Generator().manual_seed(0)
    inclusive = torch.multinomial(source_weights(1000, "range", 20.0, begin=600, end=602), 100_000, True, generator=g)
    assert chi2_pvalue(inclusive, smp.probs()) < 1e-10


@pytest.mark.parametrize("args,match", [
    ({"strategy": "later", "multiplier": 0.0}, r"^multiplier must be > 0 .*got 0\.0$"),       # source: returned
    ({"strategy": "earlier", "multiplier": -2.0}, r"^multiplier must be > 0"),
    ({"strategy": "later", "portion": 0.0009}, r"^portion must lie in \(0, 1\] .*T=1000\), got 0\.0009$"),  # all
    ({"strategy": "earlier", "portion": 0.0005}, r"^portion must lie"),                        # source: none
    ({"strategy": "later", "portion": -0.3}, r"^portion must lie"),
    ({"strategy": "earlier", "portion": 1.5}, r"^portion must lie"),
    ({"strategy": "range", "begin": 500, "end": 500}, r"^range needs 0 <= begin < end <= T=1000 \(end exclusive\)"),
    ({"strategy": "range", "begin": -1, "end": 10}, r"^range needs"),
    ({"strategy": "range", "begin": 0, "end": 1001}, r"^range needs"),
    ({"strategy": "middle"}, r"^strategy must be one of none, earlier, later, range, got 'middle'$"),
    ({"strategy": "later", "multiplier": "2"}, r"bad value for 'multiplier'"),
])
def test_refusals_are_one_line(args, match):
    with pytest.raises(InvalidInput, match=match) as e:
        fd.timestep_sampler("timestep_bias", fd.schedule("linear", T=1000), **args)
    assert "\n" not in str(e.value)


def test_range_default_end_needs_T_1000():
    with pytest.raises(InvalidInput, match="T=100 "):
        fd.timestep_sampler("timestep_bias", fd.schedule("linear", T=100), strategy="range")
    p = fd.timestep_sampler("timestep_bias", fd.schedule("linear", T=100), strategy="range", end=100).probs()
    assert (p == 1 / 100).all()  # multiplier 1: the default range biases nothing
