"""Generation and evaluation of a trained model: `sampling.py` (a bundle's guided, seeded samples in chunks),
`prompts.py` (a text run's encoders and prompt tables), `ranks.py` (sampling split across ranks by image index,
resumable chunks, ADM's .npz), `evaluate.py` (FID / KID / precision-recall / bits per dim of a bundle),
`features.py` (the offline digits extractor), `digits_cnn.py` (the second, independent digits
evaluator), `feature_stats.py` (features per chunk and reference
statistics), `report.py` (the HTML report)."""


def __getattr__(name: str):
    # `fasttrain.generation` was one module before 0.3 (ranks.py now): its names stay reachable here
    import importlib

    if not name.startswith("__"):
        module = importlib.import_module(f"{__name__}.ranks")
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
