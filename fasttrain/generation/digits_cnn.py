"""The second, independent digits evaluator: a small convolutional classifier (another architecture than
generation/features.py's MLP) trained with labels on the last 200 of the 400 held-out digits, a split
disjoint from the first evaluator's (the 1397 training images) and from the alignment encoder's
(pretrained/digits_encoder.py: the first 200 held-out ones). Its 64-d penultimate layer is registered with
torch-fidelity as the feature extractor "fasttrain-digits-cnn", so that a verdict on FID with the first
evaluator can be confirmed by FID in features of a network that shares neither its data nor its design
(`eval.extractor=fasttrain-digits-cnn`, or `eval.extra_extractors=[fasttrain-digits-cnn]` beside it).
bench/digits_assets.py trains it (fasttrain/assets/digits_cnn.pt) and reports its accuracy on the
training split, which it never saw.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .features import DigitsMLP

ASSET = Path(__file__).parent.parent / "assets" / "digits_cnn.pt"
NAME = "fasttrain-digits-cnn"
SPLIT = (200, 400)  # rows of the digits' held-out split (data/builtin.py `digits(split="test")`)


class DigitsCNN(nn.Module):
    """8×8 grey image in [-1, 1] → 64-d features → 10 logits."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.GELU(),
                                  nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GELU(),
                                  nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.GELU(),
                                  nn.Flatten(), nn.Linear(256, 64), nn.GELU())
        self.head = nn.Linear(64, 10)

    prepare = staticmethod(DigitsMLP.prepare)  # any image batch → [N, 1, 8, 8] grey, area-resized

    def forward(self, x: torch.Tensor):
        f = self.body(self.prepare(x))
        return f, self.head(f)


def register() -> None:
    """Register "fasttrain-digits-cnn" with torch-fidelity (inputs: uint8 [N, 3, H, W])."""
    from torch_fidelity import FeatureExtractorBase, register_feature_extractor
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

    if NAME in FEATURE_EXTRACTORS_REGISTRY:
        return

    class DigitsCNNFeatures(FeatureExtractorBase):
        def __init__(self, name, features_list, **kwargs):
            super().__init__(name, features_list)
            self.net = DigitsCNN()
            self.net.load_state_dict(torch.load(ASSET, map_location="cpu", weights_only=True))
            self.net.eval()

        @staticmethod
        def get_provided_features_list():
            return ("64", "logits")

        @staticmethod
        def get_default_feature_layer_for_metric(metric):
            return {"isc": "logits"}.get(metric, "64")

        @staticmethod
        def can_be_compiled():
            return False

        @staticmethod
        def get_dummy_input_for_compile():
            return torch.zeros(1, 3, 8, 8, dtype=torch.uint8)

        def forward(self, x):
            f, logits = self.net(x.float() / 127.5 - 1)
            out = {"64": f.double(), "logits": logits.double()}
            return tuple(out[k] for k in self.features_list)

    register_feature_extractor(NAME, DigitsCNNFeatures)
