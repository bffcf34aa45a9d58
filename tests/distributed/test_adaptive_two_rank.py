"""The adaptive sampler under torchrun with two gloo ranks (adaptive_two_rank.py), on a plain model and
on an FSDP2 bf16 model: the policy, S and the FIFO stay identical on both ranks, and the ranks
evaluate disjoint halves of the τ-grid of one shared x0*, which together cover it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("adaptive_two_rank.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_rank")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {kind: [json.loads((out / f"{kind}-rank{r}.json").read_text()) for r in range(2)]
            for kind in ("plain", "fsdp")}


@pytest.mark.parametrize("kind", ["plain", "fsdp"])
def test_policy_s_and_fifo_identical_on_both_ranks(ranks, kind):
    r0, r1 = ranks[kind]
    assert r0["world"] == 2 and r0["updates"] == r1["updates"] == 4  # steps 0, 2, 4, 6
    assert r0["policy"] == r1["policy"]  # bit-identical: same init, all-reduced gradient
    assert r0["S"] == r1["S"] and r0["fifo_X"] == r1["fifo_X"] and r0["hist_S"] == r1["hist_S"]
    assert r0["reward"] == r1["reward"]  # the mean over the global batch
    assert r0["model"] == r1["model"]
    assert all(abs(x) < 1e3 for row in r0["fifo_X"] for x in row) and any(x != 0 for row in r0["fifo_X"] for x in row)


@pytest.mark.parametrize("kind", ["plain", "fsdp"])
def test_ranks_split_the_tau_grid_of_one_shared_x0(ranks, kind):
    r0, r1 = ranks[kind]
    for e0, e1 in zip(r0["evaluated"], r1["evaluated"]):
        assert e0["per"] == e1["per"] == 5  # the same number of probe forwards on both ranks
        assert set(e0["index"]).isdisjoint(e1["index"])
        assert sorted(e0["index"] + e1["index"]) == list(range(10))
        assert e0["grid"] == e1["grid"]  # the same stratified draw on both ranks
        assert e0["tau"] + e1["tau"] == e0["grid"]
        assert e0["star"] == e1["star"]  # x0* broadcast from rank 0
    assert len({tuple(e["grid"]) for e in r0["evaluated"]}) == len(r0["evaluated"])  # resampled per update
