"""FID/KID/precision/recall from features: generated images' features computed where they are made (per
rank, per chunk: generation/ranks.py) and gathered, and reference statistics computed once and kept in an
`.npz` (`fasttrain eval --ref-stats`).

Features come from torch-fidelity's extractors (its Inception "inception-v3-compat", with local weights
through `weights_path`, or the project's offline "fasttrain-digits", features.py), each metric on the
layer torch-fidelity would use; the metrics are torch-fidelity's own functions on those features, so a
set evaluated here scores as `torch_fidelity.calculate_metrics` would score it.

Reference file: `mu` and `sigma` (float64; the names and meaning of ADM's reference batches, e.g.
VIRTUAL_imagenet256_labeled.npz, whose pool-3 statistics come from the TF Inception that
inception-v3-compat reproduces), and, when written here, `features_<layer>` for KID and precision/recall
and `extractor` naming the extractor. A file with statistics only gives FID.
A reference computed here is read a chunk at a time (`ReferenceStats.from_images`); rank 0 alone
computes it, once, while the other ranks wait (cli/generate.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import InvalidInput

METRICS = ("fid", "kid", "prc")


class Extractor:
    """A torch-fidelity feature extractor on uint8 [N, H, W, 3] images, giving each metric's layer."""

    def __init__(self, name: str, weights_path: str | None = None, device=None, batch: int = 128):
        from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY
        from torch_fidelity.utils import create_feature_extractor

        if name == "fasttrain-digits":
            from .features import _register

            _register()
        elif name == "fasttrain-digits-cnn":
            from .digits_cnn import register

            register()
        if name not in FEATURE_EXTRACTORS_REGISTRY:
            raise InvalidInput(f"unknown feature extractor {name!r}")
        cls = FEATURE_EXTRACTORS_REGISTRY[name]
        self.name, self.batch = name, batch
        self.layers = {m: cls.get_default_feature_layer_for_metric(m) for m in METRICS}
        kw = {"feature_extractor_weights_path": weights_path} if weights_path else {}
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.net = create_feature_extractor(name, sorted(set(self.layers.values())), cuda=False, verbose=False, **kw)
        self.net.to(self.device)

    @torch.no_grad()
    def __call__(self, images_nhwc: torch.Tensor) -> dict[str, torch.Tensor]:
        """uint8 [N, H, W, 3] → {layer: [N, D]} in the extractor's dtype (on the CPU)."""
        out: dict[str, list] = {}
        for i in range(0, len(images_nhwc), self.batch):
            x = images_nhwc[i:i + self.batch].permute(0, 3, 1, 2).contiguous().to(self.device)
            feats = self.net.convert_features_tuple_to_dict(self.net(x))
            for k, v in feats.items():
                out.setdefault(k, []).append(v.cpu())
        return {k: torch.cat(v) for k, v in out.items()}


class ReferenceStats:
    """The reference side: FID statistics of `layers["fid"]`, and features for KID/PRC where kept."""

    def __init__(self, mu: np.ndarray, sigma: np.ndarray, features: dict[str, torch.Tensor] | None = None,
                 extractor: str | None = None, source: str = ""):
        self.mu, self.sigma, self.features, self.extractor, self.source = mu, sigma, features or {}, extractor, source

    @classmethod
    def from_features(cls, feats: dict[str, torch.Tensor], ex: Extractor, source: str) -> ReferenceStats:
        from torch_fidelity.metric_fid import fid_features_to_statistics

        st = fid_features_to_statistics(feats[ex.layers["fid"]].double())
        return cls(st["mu"], st["sigma"], feats, ex.name, source)

    @classmethod
    def from_images(cls, images, ex: Extractor, chunk: int) -> ReferenceStats | None:
        """The statistics of a reference read `chunk` images at a time (data/reference.py
        `ReferenceImages`): each chunk's features are kept, its images dropped, so memory holds one chunk
        plus the features (50,000 × 2048 float32 Inception features: 0.4 GB, against ~39 GB of 256²
        float32 images). Features are per image, so the statistics are those of the whole set at once.
        None when the reference has no images."""
        from .ranks import to_uint8

        parts: dict[str, list] = {}
        for x in images.chunks(chunk):
            for k, v in ex(to_uint8(x)).items():
                parts.setdefault(k, []).append(v)
        if not parts:
            return None
        return cls.from_features({k: torch.cat(v) for k, v in parts.items()}, ex, images.source)

    def save(self, path) -> Path:
        path = Path(path)
        arrays = {"mu": self.mu, "sigma": self.sigma, "extractor": np.array(self.extractor or ""),
                  "source": np.array(self.source)}
        arrays.update({f"features_{k}": v.numpy() for k, v in self.features.items()})
        tmp = path.with_name(f".{path.name}.tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path, extractor: str) -> ReferenceStats:
        """Read `mu`/`sigma` (and features) from an .npz; one line naming the file when it does not fit."""
        try:
            with np.load(path, allow_pickle=False) as z:
                if "mu" not in z or "sigma" not in z:
                    raise InvalidInput(f"--ref-stats {path} holds no 'mu' and 'sigma' arrays (keys: "
                                       f"{', '.join(z.files)})")
                for k in ("mu", "sigma"):
                    if z[k].dtype.kind not in "fiu":  # complex, text, bool: not statistics
                        raise InvalidInput(f"--ref-stats {path}: {k} is an array of {z[k].dtype}, not of real "
                                           f"numbers")
                mu, sigma = z["mu"].astype(np.float64), z["sigma"].astype(np.float64)
                name = str(z["extractor"]) if "extractor" in z else None
                feats = {k[len("features_"):]: torch.from_numpy(z[k]) for k in z.files if k.startswith("features_")}
                source = str(z["source"]) if "source" in z else str(path)
        except (OSError, ValueError, TypeError) as e:
            if "pickle" in str(e):  # an object array, or a pickle rather than an .npz: never unpickled
                raise InvalidInput(f"--ref-stats {path} holds pickled Python objects, which fasttrain never loads "
                                   f"(allow_pickle=False): save plain float arrays 'mu' and 'sigma' "
                                   f"(numpy.savez)") from None
            why = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise InvalidInput(f"--ref-stats {path} is not a readable .npz: {why}") from None
        if name and name != extractor:
            raise InvalidInput(f"--ref-stats {path} holds statistics of the extractor {name!r}, the evaluation "
                               f"uses {extractor!r}")
        if mu.ndim != 1 or sigma.shape != (len(mu), len(mu)):
            raise InvalidInput(f"--ref-stats {path}: mu {mu.shape} and sigma {sigma.shape} do not fit together")
        bad = [k for k, a in (("mu", mu), ("sigma", sigma)) if not np.isfinite(a).all()]
        if bad:  # the FID of non-finite statistics is NaN: a result that looks like one
            raise InvalidInput(f"--ref-stats {path}: {' and '.join(bad)} hold NaN or infinite values (write the "
                               f"statistics again)")
        return cls(mu, sigma, feats, name, source)


def metrics(gen: dict[str, torch.Tensor], ref: ReferenceStats, ex: Extractor, prc: bool = True,
            kid_subset_size: int = 1000) -> dict:
    """FID (statistics), KID and precision/recall (where the reference kept its features) of the
    generated features `gen` against `ref`, by torch-fidelity's functions (generated = input 1)."""
    from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
    from torch_fidelity.metric_kid import kid_features_to_metric
    from torch_fidelity.metric_prc import prc_features_to_metric

    f = gen[ex.layers["fid"]]
    if f.shape[1] != len(ref.mu):
        raise InvalidInput(f"the reference statistics have {len(ref.mu)} features, the extractor {ex.name!r} gives "
                           f"{f.shape[1]}")
    out = {"fid": fid_statistics_to_metric(fid_features_to_statistics(f.double()), {"mu": ref.mu, "sigma": ref.sigma},
                                           False)["frechet_inception_distance"]}
    kf = ref.features.get(ex.layers["kid"])
    if kf is not None:
        size = min(len(gen[ex.layers["kid"]]), len(kf), kid_subset_size)
        k = kid_features_to_metric(gen[ex.layers["kid"]], kf, kid_subset_size=size, verbose=False)  # its defaults
        out["kid"], out["kid_std"] = k["kernel_inception_distance_mean"], k["kernel_inception_distance_std"]
    pf = ref.features.get(ex.layers["prc"])
    k = 3  # torch-fidelity's prc_neighborhood: the k-th nearest neighbour needs k + 1 samples per side
    if prc and pf is not None and min(len(gen[ex.layers["prc"]]), len(pf)) <= k:
        out["prc_error"] = f"precision/recall need more than {k} samples on each side"
    elif prc and pf is not None:
        p = prc_features_to_metric(gen[ex.layers["prc"]], pf, save_cpu_ram=True, verbose=False)
        out["precision"], out["recall"] = p["precision"], p["recall"]
    return out
