"""Class 8: the config keys added by the text, LoRA, shard, bucket and sampling work refuse wrong types and
out-of-range values at configuration, naming the key and its allowed range (config.py declares them on
the fields; configure.py the ranges that depend on another key)."""
import pytest
from common import one_line

from fasttrain.cli import main

CASES = [
    (["model.lora.rank=-1"], "'model.lora.rank': -1 (must be >= 0 and <= 4096)"),
    (["model.lora.rank=99999"], "'model.lora.rank': 99999 (must be >= 0 and <= 4096)"),
    (["model.lora.rank=four"], "'model.lora.rank'"),
    (["model.lora.alpha=0"], "'model.lora.alpha': 0.0 (must be > 0"),
    (["model.lora.alpha=-2"], "'model.lora.alpha': -2.0 (must be > 0"),
    (["model.lora.dropout=1"], "'model.lora.dropout': 1.0 (must be >= 0 and < 1)"),
    (["model.lora.target_modules=[]"], "'model.lora.target_modules': [] (a list of non-empty strings, at least 1)"),
    (["model.lora.target_modules=['']"], "'model.lora.target_modules'"),
    (["model.lora.base_dtype=fp8"], "'model.lora.base_dtype': 'fp8' (choose from auto, fp32, bf16, fp16)"),
    (["model.lora.base_dtype=bf16"], "'model.lora.base_dtype': 'bf16' (it sets the dtype of a LoRA run's"),
    (["data.shuffle_buffer=0"], "'data.shuffle_buffer': 0 (must be >= 1 and <= 1000000)"),
    (["data.shuffle_buffer=100000000"], "'data.shuffle_buffer': 100000000 (must be >= 1 and <= 1000000)"),
    (["data.min_bucket_reso=0"], "'data.min_bucket_reso': 0 (must be >= 1 and <= 16384)"),
    (["data.max_bucket_reso=100000"], "'data.max_bucket_reso': 100000 (must be >= 1 and <= 16384)"),
    (["data.bucket_reso_steps=1.5"], "'data.bucket_reso_steps'"),
    (["data.keep_tokens=-1"], "'data.keep_tokens': -1 (must be >= 0 and <= 1000)"),
    (["data.caption_dropout=1.5"], "'data.caption_dropout': 1.5 (must be >= 0 and <= 1)"),
    (["data.caption_dropout=nan"], "'data.caption_dropout'"),
    (["sample.prompts=['a cat', '  ']"], "'sample.prompts': ['a cat', '  '] (a list of non-empty strings)"),
    (["sample.spacing=middle"], "'sample.spacing': 'middle' (choose from trailing, linspace, leading)"),
    (["sample.guidance=1000"], "'sample.guidance': 1000.0 (must be >= 0 and <= 100)"),
    (["data.name=folder", "data.root=imgs", "data.buckets=true", "data.min_bucket_reso=512",
      "data.max_bucket_reso=256"], "'data.min_bucket_reso': 512 (at most data.max_bucket_reso = 256)"),
    (["data.name=folder", "data.root=imgs", "data.buckets=true", "data.bucket_reso_steps=2048",
      "data.max_bucket_reso=1024"], "'data.bucket_reso_steps': 2048 (at most data.max_bucket_reso = 1024)"),
]


@pytest.mark.parametrize("over,needle", CASES, ids=[c[0][-1] for c in CASES])
def test_newer_keys_name_themselves_and_their_range(tmp_path, monkeypatch, capsys, over, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "imgs").mkdir()
    assert main(["train", f"run_dir={tmp_path / 'run'}"] + over) == 2
    one_line(capsys, "bad value for " + needle if not needle.startswith("bad") else needle)
    assert not (tmp_path / "run").exists()  # refused at configuration: nothing written
