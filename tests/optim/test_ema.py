import pytest
import torch

from fasttrain.optim.ema import EMA, clean_name


def test_update_applied_and_state():
    m = torch.nn.Linear(3, 2)
    ema = EMA(m, decay=0.9, warmup=True)
    w0 = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.add_(1.0)
    ema.update(m)  # n = 0: decay min(0.9, 1/10) = 0.1
    torch.testing.assert_close(ema.shadow[0], 0.1 * w0 + 0.9 * (w0 + 1))
    trained = m.weight.detach().clone()
    with ema.applied(m):
        torch.testing.assert_close(m.weight, 0.1 * w0 + 0.9 * (w0 + 1))
    torch.testing.assert_close(m.weight, trained)  # the trained weights come back
    other = EMA(torch.nn.Linear(3, 2))
    other.load_state_dict(ema.state_dict())
    assert other.n == 1 and torch.equal(other.shadow[0], ema.shadow[0])
    assert ema.current_decay() == pytest.approx(min(0.9, 2 / 11))


def test_names_survive_wrappers():
    assert clean_name("module.blocks.0._checkpoint_wrapped_module.qkv.weight") == "blocks.0.qkv.weight"
    assert clean_name("_orig_mod.embed.mlp.0.weight") == "embed.mlp.0.weight"
