import pytest
import torch

from fasttrain.models import MODELS, build_model, count_params


@pytest.mark.parametrize("name,channels,size", [("unet_tiny", 1, 8), ("unet_tiny", 3, 16), ("unet_small", 3, 16),
                                                 ("dit_tiny", 1, 8), ("dit_tiny", 4, 12)])
@pytest.mark.parametrize("classes", [0, 10])
def test_image_models_shapes_and_backward(name, channels, size, classes):
    m = build_model(name, in_channels=channels, image_size=size, num_classes=classes)
    for B in (1, 3):
        x = torch.randn(B, channels, size, size)
        t = torch.randint(0, 1000, (B,))
        y = torch.randint(0, classes, (B,)) if classes else None
        out = m(x, t, y)
        assert out.shape == x.shape
    (out - torch.randn_like(out)).square().mean().backward()  # the output layer starts at zero
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_multi_head_output_channels():
    m = build_model("dit_tiny", in_channels=1, image_size=8, out_channels=3)
    assert m(torch.randn(2, 1, 8, 8), torch.tensor([1, 2])).shape == (2, 3, 8, 8)
    u = build_model("unet_tiny", in_channels=1, image_size=8, out_channels=2)
    assert u(torch.randn(2, 1, 8, 8), torch.tensor([1, 2])).shape == (2, 2, 8, 8)


def test_label_changes_output_and_null_label_is_unconditional():
    m = build_model("mlp", in_channels=2, num_classes=3)
    torch.nn.init.normal_(m.out[-1].weight)
    x, t = torch.randn(4, 2), torch.tensor([5, 5, 5, 5])
    a = m(x, t, torch.tensor([0, 0, 0, 0]))
    b = m(x, t, torch.tensor([1, 1, 1, 1]))
    assert not torch.allclose(a, b)
    torch.testing.assert_close(m(x, t, None), m(x, t, torch.full((4,), 3)))


def test_registry_and_errors():
    assert {"unet_tiny", "dit_tiny", "mlp"} <= set(MODELS)
    assert 100_000 < count_params(build_model("unet_tiny", in_channels=1, image_size=8)) < 2_000_000
    with pytest.raises(ValueError, match="unknown model 'vit'"):
        build_model("vit", in_channels=1)
    with pytest.raises(ValueError, match="not divisible by patch"):
        build_model("dit_tiny", in_channels=1, image_size=9)
