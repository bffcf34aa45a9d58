"""The digits networks beside the FID extractor (bench/digits_assets.py): the alignment encoder
(pretrained/digits_encoder.py) and the second evaluator (generation/digits_cnn.py) as shipped: disjoint
splits, what bench/results/digits-assets.md reports of them, and FID in the second evaluator's features."""
import sys
from pathlib import Path

import torch

from fasttrain.data.builtin import digits
from fasttrain.generation import digits_cnn
from fasttrain.generation.evaluate import fidelity
from fasttrain.generation.features import load_classifier
from fasttrain.pretrained import digits_encoder

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))


def test_the_splits_are_disjoint_held_out_rows():
    held, _ = digits(8, "test")
    a, b = range(*digits_encoder.SPLIT), range(*digits_cnn.SPLIT)
    assert len(held) == 400 and not set(a) & set(b) and set(a) | set(b) == set(range(400))


def test_the_shipped_networks_measure_as_reported():
    """On the 1397 training digits neither saw: the second evaluator classifies them (0.960 reported) and
    agrees with the first; the encoder's pooled tokens hold more class structure (5-NN against its own
    held-out images) than the same network with random weights (0.877 against 0.770 reported)."""
    from digits_assets import knn_accuracy

    xtr, ytr = digits(8, "train")
    held, held_y = digits(8, "test")
    lo, hi = digits_encoder.SPLIT
    cnn = digits_cnn.DigitsCNN()
    cnn.load_state_dict(torch.load(digits_cnn.ASSET, weights_only=True))
    with torch.no_grad():
        pred = cnn.eval()(xtr)[1].argmax(-1)
        assert (pred == ytr).float().mean() > 0.94
        assert (pred == load_classifier()(xtr)[1].argmax(-1)).float().mean() > 0.93
        enc, rnd = digits_encoder.encoder(), digits_encoder.random_encoder()
        z = enc(xtr)
        assert z.shape == (len(xtr), 16, 64)
        trained = knn_accuracy(enc(held[lo:hi]).mean(1), held_y[lo:hi], z.mean(1), ytr)
        random = knn_accuracy(rnd(held[lo:hi]).mean(1), held_y[lo:hi], rnd(xtr).mean(1), ytr)
    assert trained > 0.85 and trained > random + 0.05
    assert torch.equal(rnd.body[0].weight, digits_encoder.random_encoder().body[0].weight)  # seeded


def test_fid_in_the_second_evaluators_features():
    """FID alone (no KID) in the CNN's features: ~0 between a set and itself, growing with a distortion."""
    x, _ = digits(8, "train")
    same = fidelity(x[:600], x[:600], digits_cnn.NAME, prc=False, kid=False)
    assert set(same) == {"fid"} and abs(same["fid"]) < 1e-3
    small = fidelity(torch.roll(x[:600], 1, dims=3), x, digits_cnn.NAME, prc=False, kid=False)["fid"]
    large = fidelity(torch.roll(x[:600], 2, dims=3), x, digits_cnn.NAME, prc=False, kid=False)["fid"]
    assert 0 < small < large
