"""What the text-run tests share (tests/pretrained/test_text_to_image.py, tests/export/test_export_sd.py,
tests/pretrained/test_lora.py, tests/distributed/test_text_ranks.py): the tiny text run's settings, a captioned
folder prepared with a local pipeline's VAE and text encoders, and the check that a stock pipeline makes
fasttrain's samples."""
import torch
from text_fixtures import write_captioned

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main

PROMPTS = ["a red square", "a blue circle", "a photo of a red square"]

TRAIN = ["data.name=captioned_latents", "data.batch_size=4", "train.threads=1", "train.progress=false",
         "model.name=diffusers", "model.args.class_name=UNet2DConditionModel", "model.args.subfolder=unet",
         "sample.num=2", "sample.steps=2", "eval.num_samples=0", "eval.bpd=false", "train.log_every=1",
         "train.ckpt_every=0", "optim.warmup_steps=1"]


def prepare(root, pipe, name="lat", **kw):
    images = write_captioned(root / f"img-{name}", **kw)
    out = root / name
    assert main(["data", "prepare", str(images), "--vae", str(pipe), "--vae-subfolder", "vae", "--text-encoders",
                 str(pipe), "--latents-out", str(out), "--image-size", "16", "--batch-size", "4"]) == 0
    return out


def same_samples(run, out, cls, guidance=3.0, steps=4, **call):
    """fasttrain's samples (image i seeded with i) against the stock pipeline's: the latents to float32
    rounding of their scale (the tiny VAE's latents are about 50 in size), the decoded images to 1e-4."""
    b = ModelBundle.load(run, device="cpu")
    ours = b.generate(len(PROMPTS), prompts=PROMPTS, steps=steps, guidance=guidance, first_image=0, spacing="trailing")
    pipe = cls.from_pretrained(out)
    def run_pipe(output_type):
        return pipe(PROMPTS, num_inference_steps=steps, guidance_scale=guidance, height=16, width=16,
                    generator=[torch.Generator().manual_seed(i) for i in range(len(PROMPTS))], output_type=output_type,
                    **call).images

    theirs = run_pipe("latent")
    assert theirs.shape == ours.shape
    err = float((theirs - ours).abs().max())
    assert err <= 1e-5 * max(1.0, float(ours.abs().max())), err
    images = torch.from_numpy(run_pipe("np")).permute(0, 3, 1, 2)
    mine = (b.decode(ours) / 2 + 0.5).clamp(0, 1)  # the pipelines' postprocess of the decoded [-1, 1] images
    assert images.shape == mine.shape and float((images - mine).abs().max()) <= 1e-4
    return ours, pipe
