"""Train the two digits networks that the alignment study needs besides the FID extractor, and ship them:

  fasttrain/assets/digits_ssl.pt   the alignment encoder (pretrained/digits_encoder.py): SimCLR's NT-Xent
                                   loss (Chen et al. 2020, τ = 0.2) between two augmented views of each image,
                                   on the first 200 held-out digits, no labels
  fasttrain/assets/digits_cnn.pt   the second evaluator (generation/digits_cnn.py): cross-entropy with labels
                                   on the last 200 held-out digits

Neither sees the 1397 training images (which the diffusion runs and the first evaluator,
fasttrain/assets/digits_mlp.pt, train on), and the two see disjoint splits. Deterministic: seeded draws,
one thread (the same machine and torch give the same bytes). About 30 s of one CPU core.

    python bench/digits_assets.py            # writes both assets and bench/results/digits-assets.{json,md}
    python bench/digits_assets.py --check    # trains again and reports whether the shipped assets are these
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

import _env  # OpenMP's wait policy, before torch loads it; one-line argument errors; result writes


def augment(x, g):
    """A random view: a shift of up to one pixel (edge padding with the background), Gaussian noise
    (σ 0.1) and, for half the images, a 2×2 block set to the background."""
    import torch
    import torch.nn.functional as F

    n = len(x)
    pad = F.pad(x, (1, 1, 1, 1), value=-1.0)
    dx, dy = torch.randint(0, 3, (n,), generator=g), torch.randint(0, 3, (n,), generator=g)
    rows = (dy[:, None] + torch.arange(8))[:, :, None].expand(n, 8, 8)
    cols = (dx[:, None] + torch.arange(8))[:, None, :].expand(n, 8, 8)
    out = pad[torch.arange(n)[:, None, None], 0, rows, cols][:, None]
    out = out + 0.1 * torch.randn(out.shape, generator=g)
    erase = torch.rand(n, generator=g) < 0.5
    i, j = torch.randint(0, 7, (n,), generator=g), torch.randint(0, 7, (n,), generator=g)
    for k in torch.nonzero(erase).flatten().tolist():
        out[k, 0, i[k]:i[k] + 2, j[k]:j[k] + 2] = -1.0
    return out.clamp(-1, 1)


def nt_xent(a, b, tau: float = 0.2):
    """SimCLR's loss (Chen et al. 2020, Eq. 1) over the 2N views: each view's positive is its pair."""
    import torch
    import torch.nn.functional as F

    z = F.normalize(torch.cat([a, b]), dim=1)
    sim = z @ z.T / tau
    sim.fill_diagonal_(float("-inf"))
    n = len(a)
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sim, target)


def train_encoder(x, seed: int = 0, epochs: int = 300, batch: int = 100):
    import torch
    from torch import nn

    from fasttrain.pretrained.digits_encoder import DigitsEncoder

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    net = DigitsEncoder()
    head = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))  # SimCLR's projection head
    opt = torch.optim.AdamW(list(net.parameters()) + list(head.parameters()), lr=2e-3, weight_decay=1e-4)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch):
            xb = x[perm[i:i + batch]]
            za, zb = (head(net(augment(xb, g)).mean(1)) for _ in range(2))
            loss = nt_xent(za, zb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.eval(), float(loss.detach())


def train_cnn(x, y, seed: int = 0, epochs: int = 150, batch: int = 50):
    import torch
    import torch.nn.functional as F

    from fasttrain.generation.digits_cnn import DigitsCNN

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    net = DigitsCNN()
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch):
            idx = perm[i:i + batch]
            loss = F.cross_entropy(net(augment(x[idx], g))[1], y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.eval(), float(loss.detach())


def knn_accuracy(feats_bank, y_bank, feats, y, k: int = 5) -> float:
    """k-nearest-neighbour (cosine) accuracy: how much class structure the features hold without a head."""
    import torch
    import torch.nn.functional as F

    sim = F.normalize(feats, dim=1) @ F.normalize(feats_bank, dim=1).T
    votes = y_bank[sim.topk(k, dim=1).indices]
    pred = torch.mode(votes, dim=1).values
    return float((pred == y).float().mean())


def main(argv=None) -> None:
    import torch

    import fasttrain
    from fasttrain.data.builtin import digits
    from fasttrain.generation import digits_cnn
    from fasttrain.generation.features import load_classifier
    from fasttrain.pretrained import digits_encoder

    ap = _env.Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="train again; compare with the shipped assets, write nothing")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    held, held_y = digits(8, "test")
    xtr, ytr = digits(8, "train")
    lo, hi = digits_encoder.SPLIT
    enc, enc_loss = train_encoder(held[lo:hi])
    lo2, hi2 = digits_cnn.SPLIT
    cnn, cnn_loss = train_cnn(held[lo2:hi2], held_y[lo2:hi2])
    seconds = time.time() - t0
    with torch.no_grad():
        def pooled(net):  # pooled patch tokens of the training split
            return net(xtr).mean(1)

        bank, bank_y = held[lo:hi], held_y[lo:hi]  # the encoder's own images, labelled only for this measurement
        knn = knn_accuracy(enc(bank).mean(1), bank_y, pooled(enc), ytr)
        knn_random = knn_accuracy(digits_encoder.random_encoder()(bank).mean(1), bank_y,
                                  pooled(digits_encoder.random_encoder()), ytr)
        cnn_acc = float((cnn(xtr)[1].argmax(-1) == ytr).float().mean())
        mlp_acc = float((load_classifier()(held[lo2:hi2])[1].argmax(-1) == held_y[lo2:hi2]).float().mean())
        agree = float((cnn(xtr)[1].argmax(-1) == load_classifier()(xtr)[1].argmax(-1)).float().mean())
    if args.check:
        same = all(torch.equal(a, b) for a, b in zip(enc.state_dict().values(), digits_encoder.encoder().state_dict(
            ).values()))
        shipped = torch.load(digits_cnn.ASSET, weights_only=True)
        same_cnn = all(torch.equal(a, shipped[k]) for k, a in cnn.state_dict().items())
        print(f"encoder {'identical to' if same else 'DIFFERS from'} {digits_encoder.ASSET}; "
              f"evaluator {'identical to' if same_cnn else 'DIFFERS from'} {digits_cnn.ASSET}")
        return
    torch.save(enc.state_dict(), digits_encoder.ASSET)
    torch.save(cnn.state_dict(), digits_cnn.ASSET)
    info = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "fasttrain": fasttrain.__version__, "cpu": platform.processor() or platform.machine(),
                        "cores": os.cpu_count(), "threads": 1, "loadavg_1min": round(os.getloadavg()[0], 2)},
            "when": time.strftime("%Y-%m-%d %H:%M:%S"), "command": "python bench/digits_assets.py " + " ".join(
                sys.argv[1:] if argv is None else argv), "seconds": round(seconds, 1),
            "encoder": {"asset": str(digits_encoder.ASSET.name), "bytes": digits_encoder.ASSET.stat().st_size,
                        "split": f"held-out rows {lo}-{hi}", "objective": "SimCLR NT-Xent (τ 0.2), no labels",
                        "final_loss": enc_loss, "knn5_accuracy_on_train_split": knn,
                        "knn5_accuracy_random_weights": knn_random},
            "evaluator": {"asset": str(digits_cnn.ASSET.name), "bytes": digits_cnn.ASSET.stat().st_size,
                          "split": f"held-out rows {lo2}-{hi2}", "objective": "cross-entropy with labels",
                          "final_loss": cnn_loss, "accuracy_on_train_split": cnn_acc,
                          "agreement_with_first_evaluator_on_train_split": agree},
            "first_evaluator_accuracy_on_the_cnn_split": mlp_acc}
    e, v = info["encoder"], info["evaluator"]
    md = ["# The digits alignment encoder and the second evaluator", "",
          f"machine: {json.dumps(info['machine'])}  ", f"when: {info['when']}  ", f"command: `{info['command']}`  ",
          f"time: {info['seconds']} s for both", "",
          "| network | file | trained on | objective | measured on the 1397 training digits (never seen) |",
          "|---|---|---|---|---|",
          f"| alignment encoder (DigitsEncoder: 3 convs, 16 tokens × 64) | {e['asset']} ({e['bytes']} B) | "
          f"{e['split']} "
          f"| {e['objective']} | 5-NN accuracy of pooled tokens {e['knn5_accuracy_on_train_split']:.3f} "
          f"(random weights: {e['knn5_accuracy_random_weights']:.3f}) |",
          f"| second evaluator (DigitsCNN) | {v['asset']} ({v['bytes']} B) | {v['split']} | {v['objective']} | "
          f"accuracy {v['accuracy_on_train_split']:.3f}; agrees with the first evaluator on "
          f"{v['agreement_with_first_evaluator_on_train_split']:.3f} |",
          "", f"The first evaluator (digits_mlp.pt, trained on the training split) scores "
          f"{info['first_evaluator_accuracy_on_the_cnn_split']:.3f} on the second evaluator's 200 images.", ""]
    with _env.Results() as res:
        res.text("digits-assets.json", json.dumps(info, indent=2))
        res.text("digits-assets.md", "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    _env.run(main)
