"""An offline feature extractor for the built-in digits: a small MLP classifier trained by the project.

torch-fidelity's default Inception weights are downloaded at run time, which offline machines and CI
cannot do. For `digits` the project trains its own classifier instead (deterministically, in about a
second on CPU), ships the weights as `fasttrain/assets/digits_mlp.pt`, and registers it with
torch-fidelity as the feature extractor "fasttrain-digits": its 64-d penultimate layer feeds FID/KID
and precision/recall, its logits judge whether samples are recognisable digits.

Regenerate the weights with `python -m fasttrain.generation.features`.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ASSET = Path(__file__).parent.parent / "assets" / "digits_mlp.pt"
NAME = "fasttrain-digits"


class DigitsMLP(nn.Module):
    """8×8 grey image in [-1, 1] → 64-d features → 10 logits."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.GELU())
        self.head = nn.Linear(64, 10)

    @staticmethod
    def prepare(x: torch.Tensor) -> torch.Tensor:
        """Any [N, C, H, W] image batch in [-1, 1] → [N, 1, 8, 8] grey, area-resized."""
        x = x.float()
        if x.shape[1] == 3:
            x = x.mean(1, keepdim=True)
        if x.shape[-1] != 8:
            x = F.interpolate(x, size=(8, 8), mode="area")
        return x.clamp(-1, 1)

    def forward(self, x: torch.Tensor):
        f = self.body(self.prepare(x))
        return f, self.head(f)


def train_classifier(seed: int = 0, epochs: int = 60) -> DigitsMLP:
    """Full-batch-free, seeded AdamW on the digits training split with light shift augmentation."""
    from ..data.builtin import digits

    x, y = digits(8, "train")
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = DigitsMLP()
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), 64):
            idx = perm[i:i + 64]
            xb = x[idx]
            shift = torch.randint(-1, 2, (2,), generator=g).tolist()
            xb = torch.roll(xb, shifts=shift, dims=(2, 3))  # ±1 pixel: robust to small misplacements
            loss = F.cross_entropy(net(xb)[1], y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.eval()


_cached: DigitsMLP | None = None


def load_classifier() -> DigitsMLP:
    global _cached
    if _cached is None:
        net = DigitsMLP()
        net.load_state_dict(torch.load(ASSET, map_location="cpu", weights_only=True))
        _cached = net.eval().requires_grad_(False)
    return _cached


@torch.no_grad()
def judge(x: torch.Tensor, labels: torch.Tensor | None = None, threshold: float = 0.9) -> dict:
    """Mean top-class probability, share above `threshold`, classes present among the confident ones,
    and (given the labels the samples were conditioned on) how often the classifier agrees."""
    p = load_classifier()(x.cpu())[1].softmax(-1)
    top, pred = p.max(-1)
    out = {"confidence": float(top.mean()), "confident_frac": float((top > threshold).float().mean()),
           "classes_present": int(pred[top > threshold].unique().numel())}
    if labels is not None:
        out["label_agreement"] = float((pred == labels.cpu()).float().mean())
    return out


def _register() -> None:
    """Register "fasttrain-digits" with torch-fidelity (inputs: uint8 [N, 3, H, W])."""
    from torch_fidelity import FeatureExtractorBase, register_feature_extractor
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

    if NAME in FEATURE_EXTRACTORS_REGISTRY:
        return

    class DigitsFeatures(FeatureExtractorBase):
        def __init__(self, name, features_list, **kwargs):
            super().__init__(name, features_list)
            self.net = DigitsMLP()
            self.net.load_state_dict(torch.load(ASSET, map_location="cpu", weights_only=True))

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

    register_feature_extractor(NAME, DigitsFeatures)


def main() -> None:
    from ..data.builtin import digits

    net = train_classifier()
    xt, yt = digits(8, "test")
    acc = (net(xt)[1].argmax(-1) == yt).float().mean().item()
    ASSET.parent.mkdir(exist_ok=True)
    torch.save(net.state_dict(), ASSET)
    print(f"saved {ASSET} ({ASSET.stat().st_size} bytes); held-out accuracy {acc:.4f}")


if __name__ == "__main__":
    main()
