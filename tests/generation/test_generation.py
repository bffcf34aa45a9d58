"""Generation by image index (generation/ranks.py): per-image seeds, the rank split, resumable chunks, the ADM
`.npz`, and `eval --ref-stats` (feature_stats.py). The two-rank equality: tests/distributed/test_generation_ranks.py."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.generation import ranks as gen

TINY = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1",
        "model.args.ch=8", "train.steps=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("gen") / "run"
    assert main(["train", f"run_dir={run}"] + TINY) == 0  # digits 8×8, 10 classes
    return run


def test_chunks_split_every_index_once_on_any_rank_count():
    for n, chunk in ((10, 3), (7, 7), (5, 64)):
        whole = gen.chunks(n, chunk)
        for world in (1, 2, 3):
            parts = [c for r in range(world) for c in gen.chunks(n, chunk, r, world)]
            assert sorted(parts) == whole  # each chunk on exactly one rank, the same chunks as one rank
        assert [i for _, lo, hi in whole for i in range(lo, hi)] == list(range(n))
    assert gen.labels_for(8, 12, 10, None).tolist() == [8, 9, 0, 1] and gen.labels_for(0, 2, 10, 3).tolist() == [3, 3]
    assert gen.labels_for(0, 2, 0, None) is None


def test_each_image_has_its_own_noise_whatever_its_batch(run):
    b = ModelBundle.load(run)
    kw = dict(seed=7, steps=3, solver="ddpm")  # ancestral: fresh noise at every step, from each image's own stream
    labels = torch.arange(6) % 10
    whole = b.generate(6, labels, first_image=0, **kw)
    tail = b.generate(2, labels[4:], first_image=4, **kw)
    split = torch.cat([b.generate(3, labels[i:i + 3], first_image=i, chunk=2, **kw) for i in (0, 3)])
    torch.testing.assert_close(whole[4:], tail, atol=1e-5, rtol=0)  # another batch: the same image
    torch.testing.assert_close(whole, split, atol=1e-5, rtol=0)
    assert not torch.allclose(whole[0], whole[1])
    other = b.generate(2, labels[4:], first_image=4, seed=8, steps=3, solver="ddpm")
    assert (other - tail).abs().max() > 0.1  # the base seed matters
    # image i is the image one generator seeded with seed + i makes alone (EDM2's seeds; a diffusers
    # pipeline given [manual_seed(seed + i) ...] draws the same noise), e.g. today's `sample --n 1 --seed 11`
    for i in (0, 4):
        alone = b.generate(1, labels[i:i + 1], seed=7 + i, steps=3, solver="ddpm")  # the batch generator path
        torch.testing.assert_close(whole[i:i + 1], alone, atol=1e-5, rtol=0)


def _pngs(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("[0-9]*.png"))}


def test_sample_resumes_a_killed_run_and_writes_the_adm_npz(run, tmp_path, capsys):
    out, npz = tmp_path / "s", tmp_path / "s.npz"
    argv = ["sample", "--ckpt", str(run), "--n", "7", "--steps", "2", "--chunk", "3", "--seed", "5", "--out", str(out)]
    assert main(argv + ["--npz", str(npz)]) == 0
    first = _pngs(out)
    assert len(first) == 7 and (out / "grid.png").is_file()
    with np.load(npz) as z:  # ADM's evaluator layout: arr_0 uint8 NHWC RGB, arr_1 the labels
        assert z["arr_0"].dtype == np.uint8 and z["arr_0"].shape == (7, 8, 8, 3)
        assert z["arr_1"].tolist() == [0, 1, 2, 3, 4, 5, 6]
        for i in range(7):
            assert np.array_equal(z["arr_0"][i], np.asarray(Image.open(out / f"{i:05d}.png")))
        arr = z["arr_0"].copy()
    # "killed" during chunk 1: its file and one of its PNGs gone; the rerun makes only that chunk again
    store = gen.ChunkStore(out)
    kept = store.path(0).stat().st_mtime_ns, store.path(2).stat().st_mtime_ns
    store.path(1).unlink()
    (out / "00004.png").unlink()
    (out / "grid.png").unlink()
    capsys.readouterr()
    assert main(argv) == 0
    assert "(2 chunks of 3 were there already)" in capsys.readouterr().out
    assert (store.path(0).stat().st_mtime_ns, store.path(2).stat().st_mtime_ns) == kept
    assert _pngs(out) == first and (out / "grid.png").is_file()
    assert main(argv + ["--npz", str(tmp_path / "again.npz")]) == 0  # all there: nothing generated, the npz again
    with np.load(tmp_path / "again.npz") as z:
        assert np.array_equal(z["arr_0"], arr)
    # other settings into the same folder: refused, one line naming the key, nothing touched
    capsys.readouterr()
    assert main(argv[:-2] + ["--seed", "6", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "other settings (seed: 5 there, 6 now)" in err and "00000.png, 7 files" in err
    assert _pngs(out) == first
    # one image on its own (another --n, another chunk) is the same image: its seed is (seed, index)
    assert main(["sample", "--ckpt", str(run), "--n", "1", "--steps", "2", "--seed", "5", "--label", "0",
                 "--out", str(tmp_path / "one")]) == 0
    one = np.asarray(Image.open(tmp_path / "one" / "00000.png")).astype(int)
    assert np.abs(one - arr[0]).max() <= 1  # (a batch of 1, not 3: the float sums may round apart)


def test_npz_refused_for_points_and_bad_flags(tmp_path, capsys):
    run = tmp_path / "pts"
    assert main(["train", f"run_dir={run}", "data.name=moons", "model.name=mlp", "train.steps=1",
                 "train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false"]) == 0
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(run), "--n", "4", "--steps", "2", "--out", str(tmp_path / "s"),
                 "--npz", str(tmp_path / "x.npz")]) == 1
    assert "--npz: this model does not make images" in capsys.readouterr().err
    assert main(["sample", "--ckpt", str(run), "--n", "5", "--steps", "2", "--chunk", "2",
                 "--out", str(tmp_path / "s")]) == 0
    assert torch.load(tmp_path / "s" / "samples.pt", weights_only=True).shape == (5, 2)


def test_eval_writes_reference_statistics_once_and_reads_them(run, tmp_path, capsys):
    stats = tmp_path / "ref.npz"
    base = ["eval", "--ckpt", str(run), "--n", "24", "--steps", "2", "--no-bpd", "--chunk", "10"]
    assert main(base + ["--ref-stats", str(stats), "--out", str(tmp_path / "a.json")]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    assert stats.is_file() and a["fid"] > 0 and "kid" in a and "precision" in a and 0 <= a["digits_confidence"] <= 1
    with np.load(stats) as z:
        assert z["mu"].shape == (64,) and z["sigma"].shape == (64, 64) and str(z["extractor"]) == "fasttrain-digits"
        mu, sigma = z["mu"], z["sigma"]
    # read back (the reference is not loaded again): the same numbers; the samples' chunks reused
    assert main(base + ["--ref-stats", str(stats), "--out", str(tmp_path / "b.json")]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["fid"] == a["fid"] and b["kid"] == a["kid"] and "reused" in b["samples"]
    # statistics only (as ADM's reference batches hold them): FID, no KID / precision
    adm = tmp_path / "adm.npz"
    np.savez(adm, mu=mu.astype(np.float32), sigma=sigma.astype(np.float32), arr_0=np.zeros((1, 8, 8, 3), np.uint8))
    assert main(base + ["--ref-stats", str(adm), "--out", str(tmp_path / "c.json")]) == 0
    c = json.loads((tmp_path / "c.json").read_text())
    assert abs(c["fid"] - a["fid"]) < 1e-3 * a["fid"] and "kid" not in c and "precision" not in c
    bad = tmp_path / "bad.npz"
    np.savez(bad, arr_0=np.zeros(3))
    capsys.readouterr()
    assert main(base + ["--ref-stats", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no 'mu' and 'sigma'" in err and str(bad) in err


def test_an_exported_pipeline_given_one_generator_per_image_makes_the_sampled_images(tmp_path):
    pytest.importorskip("diffusers")
    from diffusers import DiffusionPipeline
    from diffusers_fixtures import perturbed_run

    from fasttrain.export.dispatch import export_diffusers

    assert main(["train", f"run_dir={tmp_path / 'r'}"] + TINY) == 0
    run = perturbed_run(tmp_path / "r", tmp_path / "p", scale=0.03)
    export_diffusers(str(run), str(tmp_path / "out"))
    pipe = DiffusionPipeline.from_pretrained(str(tmp_path / "out"), trust_remote_code=True)
    pipe.set_progress_bar_config(disable=True)
    got = pipe(class_labels=[0, 1, 2], num_inference_steps=4, output_type="pt",
               generator=[torch.Generator().manual_seed(7 + i) for i in range(3)]).images  # the model card's call
    x = ModelBundle.load(run, device="cpu").generate(3, torch.arange(3), seed=7, steps=4, first_image=0)
    assert x.abs().max() > 0.1
    torch.testing.assert_close(got, (x * 0.5 + 0.5).clamp(0, 1), rtol=0, atol=1e-4)


def test_outputs_never_overwrite_what_the_command_reads(run, tmp_path, capsys):
    for argv, needle in ((["sample", "--ckpt", str(run), "--n", "2", "--out", str(tmp_path / "s"), "--npz",
                           str(run / "last.pt")], "--npz"),
                         (["eval", "--ckpt", str(run), "--n", "2", "--ref-stats", str(run / "last.pt")],
                          "--ref-stats")):
        capsys.readouterr()
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and needle in err, err
    assert torch.load(run / "last.pt", weights_only=False)["train"]["step"] == 2  # read, never written
    # two samples: FID and KID, and a note instead of precision/recall (k-th neighbours need more)
    assert main(["eval", "--ckpt", str(run), "--n", "2", "--steps", "2", "--no-bpd",
                 "--out", str(tmp_path / "e.json")]) == 0
    ev = json.loads((tmp_path / "e.json").read_text())
    assert "fid" in ev and "kid" in ev and "precision" not in ev and "more than 3 samples" in ev["prc_error"]
