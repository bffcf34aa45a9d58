"""Generation and evaluation of a trained model: `sampling.py` (a bundle's guided, seeded samples in chunks),
`prompts.py` (a text run's encoders and prompt tables), `ranks.py` (sampling split across ranks by image index,
resumable chunks, ADM's .npz), `evaluate.py` (FID / KID / precision-recall / bits per dim of a bundle),
`features.py` (the offline digits extractor), `digits_cnn.py` (the second, independent digits
evaluator), `feature_stats.py` (features per chunk and reference
statistics), `report.py` (the HTML report), `class_images.py` (DreamBooth class images made by a base pipeline
folder's own model, seeded per image and resumable: `fasttrain data class-images`)."""


from .. import _names_of

# `fasttrain.generation` was one module before 0.3 (ranks.py now): its names stay reachable here
__getattr__ = _names_of(__name__, "ranks")
