"""Generation and evaluation of a trained model: `ranks.py` (sampling split across ranks by image index,
resumable chunks, ADM's .npz), `evaluate.py` (FID / KID / precision-recall / bits per dim of a bundle),
`features.py` (the offline digits extractor), `feature_stats.py` (features per chunk and reference
statistics), `report.py` (the HTML report)."""
