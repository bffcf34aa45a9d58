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


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_preset_builds_on_meta_with_known_size(name):
    """Output shapes on the meta device (no memory even for XL), parameters and FLOPs per image."""
    from fasttrain.models import forward_flops, param_count

    kw = (dict(in_channels=2) if name == "mlp" else
          dict(in_channels=4, image_size=32) if name.startswith("dit_") and name != "dit_tiny" else
          dict(in_channels=3, image_size=int(name.split("_")[1])) if name.startswith("adm_") else
          dict(in_channels=1, image_size=8))
    with torch.device("meta"):
        m = build_model(name, num_classes=10, **kw)
        shape = (2, kw["in_channels"]) + ((kw["image_size"],) * 2 if "image_size" in kw else ())
        assert m(torch.empty(shape), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)).shape == shape
    assert param_count(name, **kw) > 0 and forward_flops(name, **kw) > 0


@pytest.mark.parametrize("name,params_m,gflops", [("dit_s2", 33.0, 12.1), ("dit_b2", 130.3, 46.0),
                                                   ("dit_xl2", 675.1, 237.2)])
def test_dit_family_matches_the_paper(name, params_m, gflops):
    """DiT Table 4 (latent 32×32×4, class-conditional): parameters and Gflops (paper counts one
    multiply-add as one flop: 6.06 / 23.01 / 118.64)."""
    from fasttrain.models import forward_flops, param_count

    kw = dict(in_channels=4, image_size=32, num_classes=1000, out_channels=8)  # learn_sigma doubles the output
    assert param_count(name, **kw) / 1e6 == pytest.approx(params_m, rel=0.01)
    assert forward_flops(name, **kw) / 1e9 == pytest.approx(gflops, rel=0.01)
