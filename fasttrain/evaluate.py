"""Sample-quality checks that run offline.

`DigitJudge`: a logistic-regression classifier fitted on the digits training split (deterministic,
~97% accuracy on the held-out split). Generated 8×8 digits count as recognisable when it is confident
about them; for class-conditional samples it also checks that the digit is the one asked for.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .data.builtin import digits


class DigitJudge:
    def __init__(self, holdout: int = 400):
        from sklearn.linear_model import LogisticRegression

        x, y = digits(8, "train", holdout)
        self.clf = LogisticRegression(max_iter=3000, C=1.0).fit(self._flat(x), y.numpy())
        xt, yt = digits(8, "test", holdout)
        self.test_accuracy = float((self.clf.predict(self._flat(xt)) == yt.numpy()).mean())
        self.real = self.judge(xt, yt)

    @staticmethod
    def _flat(x: torch.Tensor) -> np.ndarray:
        x = x.float()
        if x.shape[-1] != 8:
            x = F.interpolate(x, size=(8, 8), mode="area")
        return x.clamp(-1, 1).flatten(1).cpu().numpy()

    def judge(self, x: torch.Tensor, labels: torch.Tensor | None = None, threshold: float = 0.9) -> dict:
        """Mean top-class probability, fraction above `threshold`, classes present, and (given the
        labels the samples were conditioned on) how often the classifier agrees with them."""
        p = self.clf.predict_proba(self._flat(x))
        top, pred = p.max(1), p.argmax(1)
        out = {"confidence": float(top.mean()), "confident_frac": float((top > threshold).mean()),
               "classes_present": int(len(np.unique(pred[top > threshold])))}
        if labels is not None:
            out["label_agreement"] = float((pred == labels.cpu().numpy()).mean())
        return out
