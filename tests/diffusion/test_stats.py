import numpy as np
import pytest
import torch

from fasttrain import diffusion as fd


def _batches(T=7, steps=12, B=9, seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        t = torch.randint(0, T, (B,), generator=g)
        t[:4] = 2  # many samples on one timestep
        raw = offset + torch.rand(B, generator=g, dtype=torch.float64) * 3
        out.append((t, raw, raw * (t.double() + 1)))
    return out


def _numpy_moments(batches, T, kind):
    vals = {k: [] for k in range(T)}
    for t, raw, w in batches:
        v = raw if kind == "raw" else w
        for ti, vi in zip(t.tolist(), v.tolist()):
            vals[ti].append(vi)
    count = np.array([len(vals[k]) for k in range(T)], dtype=float)
    mean = np.array([np.mean(vals[k]) if vals[k] else np.nan for k in range(T)])
    var = np.array([np.var(vals[k], ddof=1) if len(vals[k]) > 1 else np.nan for k in range(T)])
    return count, mean, var, vals


@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_against_numpy(offset):
    T = 7
    batches = _batches(T, offset=offset)
    st = fd.TimestepStats(T)
    for i, (t, raw, w) in enumerate(batches):
        st.add(t, raw, w)
        if i % 5 == 4:  # merge windows of several steps, as the trainer does every K steps
            st.all_reduce()
    st.all_reduce()
    for kind in ("raw", "weighted"):
        count, mean, var, _ = _numpy_moments(batches, T, kind)
        np.testing.assert_array_equal(st.count.numpy(), count)
        np.testing.assert_allclose(st.means(kind).numpy(), mean, rtol=1e-12)
        np.testing.assert_allclose(st.variance(kind).numpy(), var, rtol=1e-8)


def test_windows_are_centred_on_the_running_mean():
    """Losses around 1e6 with spread ~1: unshifted Σ² - (Σ)²/n in fp64 would leave ~1e-4 relative
    error per window; shifted by the running mean the variance stays exact."""
    T = 3
    st = fd.TimestepStats(T)
    g = torch.Generator().manual_seed(0)
    first = 1e6 + torch.rand(T, generator=g, dtype=torch.float64)
    st.add(torch.arange(T), first, first)  # one loss per timestep: M2 = 0 exactly, pivot = that loss
    st.all_reduce()
    allv = [[v] for v in first.tolist()]
    for _ in range(20):
        t = torch.randint(0, T, (16,), generator=g)
        v = 1e6 + torch.rand(16, generator=g, dtype=torch.float64)
        st.add(t, v, v)
        for ti, vi in zip(t.tolist(), v.tolist()):
            allv[ti].append(vi)
        st.all_reduce()
    np.testing.assert_allclose(st.variance().numpy(), [np.var(a, ddof=1) for a in allv], rtol=1e-9)


def test_bucketed_view_against_numpy():
    T = 7
    batches = _batches(T)
    st = fd.TimestepStats(T)
    for t, raw, w in batches:
        st.add(t, raw, w)
    st.all_reduce()
    b = st.bucketed(3, "weighted")
    assert b["edges"] == [0, 2, 5, 7]
    _, _, _, vals = _numpy_moments(batches, T, "weighted")
    for i, (lo, hi) in enumerate([(0, 2), (2, 5), (5, 7)]):
        pooled = sum((vals[k] for k in range(lo, hi)), [])
        assert b["count"][i].item() == len(pooled)
        assert b["mean"][i].item() == pytest.approx(np.mean(pooled), rel=1e-12)
        assert b["var"][i].item() == pytest.approx(np.var(pooled, ddof=1), rel=1e-10)


def test_ema_view():
    st = fd.TimestepStats(3, ema_decay=0.5)
    for vals in ([1.0, 3.0], [5.0], [7.0, 9.0]):
        t = torch.zeros(len(vals), dtype=torch.long)
        v = torch.tensor(vals, dtype=torch.float64)
        st.add(t, v, v)
        st.all_reduce()
    # window means 2, 5, 8: ema = 2 → 0.5·2 + 0.5·5 = 3.5 → 0.5·3.5 + 0.5·8 = 5.75
    assert st.ema_view("raw")[0].item() == pytest.approx(5.75)
    assert torch.isnan(st.ema_view("raw")[1:]).all()


def test_pending_until_all_reduce_and_state_round_trip():
    st = fd.TimestepStats(5, history=2)
    st.add(torch.tensor([1, 1, 3]), torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0]))
    assert st.count.sum() == 0  # nothing visible before the sync
    st.all_reduce()
    st.add(torch.tensor([4]), torch.tensor([5.0]), torch.tensor([10.0]))  # pending at save time
    other = fd.TimestepStats(5, history=2)
    other.load_state_dict(st.state_dict())
    other.load_window_state(st.window_state())
    st.all_reduce()
    other.all_reduce()
    for k in ("raw", "weighted"):
        torch.testing.assert_close(st.means(k), other.means(k), equal_nan=True)
    torch.testing.assert_close(st.ring, other.ring)
    assert st.count.tolist() == [0, 2, 0, 1, 1]


def test_ring_keeps_the_last_losses_in_order():
    st = fd.TimestepStats(2, history=3)
    v = torch.arange(1.0, 6.0)
    st.add(torch.zeros(5, dtype=torch.long), v, v)  # 5 losses on t=0, ring of 3
    st.all_reduce()
    ring, count = st.history_ring(3)
    assert sorted(ring[0].tolist()) == [3.0, 4.0, 5.0] and count.tolist() == [5, 0]
    st.add(torch.zeros(1, dtype=torch.long), torch.tensor([6.0]), torch.tensor([6.0]))
    st.all_reduce()
    assert sorted(st.ring[0].tolist()) == [4.0, 5.0, 6.0]
    with pytest.raises(ValueError, match="history of 3"):
        st.history_ring(10)
