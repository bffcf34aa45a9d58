"""Post-hoc EMA under FSDP2 on two ranks: snapshots are sharded DCP folders, resume on two ranks is exact
(the same snapshots as the run that never stopped), one process resumes the sharded profiles, and
`fasttrain ema` reads DCP and file snapshots alike without a process group."""
import pytest
import torch
from torchrun_launch import cli

from fasttrain.checkpoint import snapshots
from fasttrain.cli import main
from fasttrain.optim import phema

BASE = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "data.batch_size=8",
        "train.log_every=1", "train.threads=1", "model.args.ch=8", "phema.every=2", "train.ckpt_every=0",
        "train.plots=false"]


def _like(snap):
    meta = snapshots.read_meta(snap)
    from fasttrain.optim.ema import clean_name, trained
    from fasttrain.optim.posthoc import _network

    return {clean_name(n): p.detach() for n, p in trained(_network(meta))}, len(meta["sigma_rels"])


def test_sharded_snapshots_resume_on_one_process_and_reconstruct(tmp_path):
    a = tmp_path / "a"
    cli(["train", f"run_dir={a}", "train.steps=4"] + BASE)
    found = snapshots.find(a)
    assert [s.step for s in found] == [2, 4]
    assert all(s.path.is_dir() and (s.path / ".metadata").is_file() for s in found)
    assert snapshots.read_meta(found[-1])["images"] == 4 * 16  # 2 ranks × batch 8 per step
    # 2 → 1: one process resumes the sharded profiles; its snapshot is a file beside the DCP folders
    assert main(["train", f"run_dir={a}", "train.steps=6", "--resume"] + BASE) == 0
    found = snapshots.find(a)
    assert [s.step for s in found] == [2, 4, 6] and found[-1].path.is_file()
    like, k = _like(found[-1])
    assert main(["ema", str(a), "--sigma-rel", "0.1", "0.13"]) == 0
    rec = torch.load(a / "ema" / "phema-000000006-0.1000.pt", weights_only=True)
    last = snapshots.read_shadows(found[-1], like, k)["p1"]  # σ_rel 0.1 is tracked: reproduced exactly
    for n, v in last.items():
        torch.testing.assert_close(rec["ema"]["shadow"][n], v, rtol=0, atol=1e-6)
    # σ_rel 0.13 is not: the least-squares mix of the DCP and the file snapshots at their times (images)
    times = [float(snapshots.read_meta(s)["images"]) for s in found]
    assert times == [32.0, 64.0, 80.0]
    c = phema.coefficients([t for t in times for _ in (0, 1)], [0.05, 0.1] * 3, times[-1], [0.13])[:, 0]
    shadows = [snapshots.read_shadows(s, like, k) for s in found]
    mixed = {n: sum(float(c[2 * i + j]) * sh[f"p{j}"][n].double() for i, sh in enumerate(shadows) for j in (0, 1))
             for n in like}
    rec13 = torch.load(a / "ema" / "phema-000000006-0.1300.pt", weights_only=True)["ema"]["shadow"]
    for n in like:
        torch.testing.assert_close(rec13[n].double(), mixed[n], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_two_rank_resume_writes_the_snapshots_of_the_run_that_never_stopped(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    cli(["train", f"run_dir={a}", "train.steps=6"] + BASE)
    cli(["train", f"run_dir={b}", "train.steps=3"] + BASE)
    cli(["train", f"run_dir={b}", "train.steps=6", "--resume"] + BASE)
    sa, sb = snapshots.find(a), snapshots.find(b)
    assert [s.step for s in sa] == [s.step for s in sb] == [2, 4, 6]
    like, k = _like(sa[-1])
    for x, y in zip(sa, sb):
        px, py = snapshots.read_shadows(x, like, k), snapshots.read_shadows(y, like, k)
        for p in px:
            for n in px[p]:
                assert torch.equal(px[p][n], py[p][n]), (x.step, p, n)
