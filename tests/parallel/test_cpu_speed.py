"""Issue 35's CPU speed changes keep what the step computes: the parameters the step clips and the EMA
reads are listed once (and found again when a wrapper replaces them), evaluations inside a CPU run use
every core and give the training thread count back, UNet attention's matmul form equals its Conv1d form."""
import pytest
import torch
from torch import nn

from fasttrain.models.unet import AttnBlock, group_norms
from fasttrain.optim.ema import EMA
from fasttrain.parallel.cpu import cores, evaluation_threads
from fasttrain.step import Generators, StepParts


@pytest.mark.parametrize("batch,channels,size,heads", [(3, 16, 4, 2), (2, 32, 3, 4)])
def test_unet_attention_as_matmuls_equals_its_conv1d_form(batch, channels, size, heads):
    torch.manual_seed(0)
    a = AttnBlock(channels, heads, group_norms(channels))
    nn.init.normal_(a.proj.weight, std=0.5)  # zero-initialised in training: the output would not see the attention
    nn.init.normal_(a.qkv.bias)
    x = torch.randn(batch, channels, size, size, requires_grad=True)
    out = a(x)
    grads = torch.autograd.grad(out.square().sum(), [x, a.qkv.weight, a.proj.weight, a.qkv.bias])
    ref = a.forward_conv(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, a.qkv.weight, a.proj.weight, a.qkv.bias])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
    assert (out - x).abs().max() > 0.1  # the attention changed the input: the comparison saw it
    # the parameters are still a Conv1d's: checkpoints and the diffusers export read the same keys
    assert a.state_dict()["qkv.weight"].shape == (3 * channels, channels, 1)


def test_the_step_lists_the_parameters_it_clips_once():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    parts = StepParts(model, None, torch.optim.SGD(model.parameters(), lr=0.1), Generators())
    assert parts.params == list(model.parameters())


def test_the_ema_walks_the_model_once_and_again_when_its_parameters_are_replaced(monkeypatch):
    m = nn.Linear(3, 2)
    ema = EMA(m, decay=0.5, warmup=False)
    walks = []
    real = nn.Module.named_modules

    def counted(self, *a, **kw):
        walks.append(self)
        return real(self, *a, **kw)

    monkeypatch.setattr(nn.Module, "named_modules", counted)
    ema.update(m)
    first = len(walks)
    for _ in range(3):
        ema.update(m)
    # later updates only peek at the first parameter (one walk that stops at once), never list them all
    assert first >= 2 and len(walks) - first == 3
    # a wrapper that replaces the parameters (as FSDP's fully_shard does): the new ones are read
    m.weight = nn.Parameter(torch.full_like(m.weight, 3.0))
    before = ema.shadow[0].clone()
    ema.update(m)
    torch.testing.assert_close(ema.shadow[0], 0.5 * before + 0.5 * 3.0)


def test_evaluations_of_a_cpu_run_use_every_core_and_give_the_training_threads_back():
    kept = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with evaluation_threads(0, cpu_run=True):
            inside = torch.get_num_threads()
        assert inside == cores() and torch.get_num_threads() == 1
        with evaluation_threads(1, cpu_run=True):  # train.threads=1 forced: kept for evaluation too
            assert torch.get_num_threads() == 1
        with evaluation_threads(0, cpu_run=False):  # a GPU run (or torchrun's ranks): left alone
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(kept)


def test_the_cpu_ema_lerp_matches_the_average_and_a_skipped_step_leaves_it_unchanged():
    torch.manual_seed(0)
    m = nn.Linear(5, 4)
    ema = EMA(m, decay=0.99, warmup=True)
    for n in range(12):  # across warm-up's switch of lerp's formula (weight above and below 0.5)
        expected = [s.clone() for s in ema.shadow]
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p))
        w = 1 - min(0.99, (1 + n) / (10 + n))
        ema.update(m)
        for s, e, p in zip(ema.shadow, expected, m.parameters()):
            torch.testing.assert_close(s, e + w * (p.detach() - e), atol=1e-6, rtol=1e-6)
    kept = [s.clone() for s in ema.shadow]
    with torch.no_grad():
        m.weight.add_(1.0)
    ema.update(m, applied=torch.tensor(False))
    assert all(torch.equal(s, k) for s, k in zip(ema.shadow, kept))
