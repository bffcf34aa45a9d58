"""Small generated image and latent folders whose content identifies each file."""
import numpy as np
from PIL import Image


def write_images(root, n_per_class=6, size=(20, 28), classes=("cat", "dog"), corrupt=0):
    """Class folders of alternating PNG/JPEG files; file i's image is a flat grey of level 10·i + 5,
    with a small gradient, so its identity survives decoding and resizing."""
    paths = []
    i = 0
    for c in classes:
        d = root / c
        d.mkdir(parents=True, exist_ok=True)
        for k in range(n_per_class):
            h, w = size
            arr = np.full((h, w, 3), 10 * i + 5, dtype=np.uint8)
            arr[:, :, 1] = np.clip(arr[:, :, 1] + np.arange(w)[None, :] // 4, 0, 255).astype(np.uint8)
            p = d / f"{k:03d}.{'png' if k % 2 else 'jpg'}"
            Image.fromarray(arr).save(p, quality=95)
            paths.append(p)
            i += 1
    for k in range(corrupt):
        bad = root / classes[0] / f"broken{k}.jpg"
        bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
        paths.append(bad)
    return paths


def write_latents(root, n_per_class=5, shape=(4, 6, 6), classes=("0", "1", "2")):
    """One .npy per sample; element [0, 0, 0] holds the file's index."""
    rng = np.random.default_rng(0)
    i = 0
    for c in classes:
        d = root / c
        d.mkdir(parents=True, exist_ok=True)
        for k in range(n_per_class):
            a = rng.standard_normal(shape).astype(np.float32)
            a[0, 0, 0] = i
            np.save(d / f"{k:03d}.npy", a)
            i += 1


