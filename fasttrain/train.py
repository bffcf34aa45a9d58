"""The training loop: AdamW with warm-up, EMA, gradient clipping and accumulation, seeded everything,
atomic checkpoints with exact resume, JSONL + TensorBoard metrics, a progress bar, and at the end a
sample grid and per-timestep plots.

Progress is counted in images as well as steps (EDM2). The step itself never syncs with the host:
losses are accumulated on the device and read once per `train.log_every` steps.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.optim.swa_utils import AveragedModel
from torchvision.utils import save_image
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import plots
from .config import Config
from .data import build_data
from .diffusion import DiffusionObjective, schedule as make_schedule
from .logger import MetricLogger, read_jsonl
from .models import build_model, count_params
from .sample import sample

# Sections that must match for a checkpoint to be resumed (the rest may change, e.g. train.steps).
RESUME_MUST_MATCH = ("data", "model", "diffusion")


def ema_model(model: torch.nn.Module, decay: float, warmup: bool) -> AveragedModel:
    """EMA through torch's AveragedModel; with warm-up the decay is min(decay, (1+n)/(10+n))."""
    def avg(ema_params, params, n):
        d = min(decay, (1 + float(n)) / (10 + float(n))) if warmup else decay
        torch._foreach_lerp_(ema_params, params, 1 - d)

    return AveragedModel(model, multi_avg_fn=avg, use_buffers=True)


def _config_diff(a: dict, b: dict, prefix: str = "") -> str | None:
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            d = _config_diff(va, vb, f"{prefix}{k}.")
            if d:
                return d
        elif va != vb:
            return f"{prefix}{k}"
    return None


class Trainer:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        tc = cfg.train
        if tc.threads > 0:
            torch.set_num_threads(tc.threads)
        want_cuda = tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())
        if want_cuda and not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but no CUDA device is available")
        self.device = torch.device("cuda" if want_cuda else "cpu")
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(tc.seed)

        d = cfg.data
        self.data, self.info = build_data(d.name, batch_size=d.batch_size, seed=tc.seed, image_size=d.image_size,
                                          root=d.root, channels=d.channels, holdout=d.holdout, device=self.device,
                                          num_workers=d.num_workers, backend=d.backend, manifest=d.manifest,
                                          crop=d.crop, flip=d.flip)
        self.num_classes = self.info.num_classes if cfg.model.class_conditional else 0
        self.model = build_model(cfg.model.name, in_channels=self.info.channels, image_size=self.info.image_size,
                                 num_classes=self.num_classes, **cfg.model.args).to(self.device)
        df = cfg.diffusion
        self.schedule = make_schedule(df.schedule, df.T, df.zero_terminal_snr).to(self.device)
        self.objective = DiffusionObjective(
            self.schedule, df.prediction, df.weighting, df.sampler,
            weighting_args=dict(df.weighting_args), sampler_args=dict(df.sampler_args),
            learned_weighting=df.learned_weighting, backend=df.backend, seed=tc.seed).to(self.device)
        self.objective.sampler.set_partition(0, 1, tc.grad_accum)
        params = list(self.model.parameters()) + list(self.objective.parameters())
        o = cfg.optim
        self.opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, foreach=True)
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
        self.ema = ema_model(self.model, o.ema_decay, o.ema_warmup)
        self.gen = torch.Generator(self.device).manual_seed(tc.seed + 1)  # timesteps and label dropout
        self.step = 0
        self.images_per_step = d.batch_size * tc.grad_accum

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "config": OmegaConf.to_container(self.cfg), "model": self.model.state_dict(),
                "ema": self.ema.state_dict(), "optimizer": self.opt.state_dict(),
                "lr_sched": self.lr_sched.state_dict(), "objective": self.objective.state_dict(),
                "objective_extra": self.objective.extra_state(), "data": self.data.state_dict(),
                "gen": self.gen.get_state(), "rng": ckpt.rng_state()}

    def save(self, name: str = "last.pt") -> Path:
        return ckpt.save(self.run_dir / name, self.state_dict())

    def load(self, path: str | Path) -> None:
        state = ckpt.load(path, map_location="cpu")  # RNG states must stay CPU tensors; modules copy to device
        mine = OmegaConf.to_container(self.cfg)
        for section in RESUME_MUST_MATCH:
            diff = _config_diff(state["config"][section], mine[section], section + ".")
            if diff:
                raise ValueError(f"cannot resume {path}: config key '{diff}' differs from the checkpoint")
        self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema"])
        self.opt.load_state_dict(state["optimizer"])
        self.lr_sched.load_state_dict(state["lr_sched"])
        self.objective.load_state_dict(state["objective"])
        self.objective.load_extra_state(state["objective_extra"])
        self.data.load_state_dict(state["data"])
        self.gen.set_state(state["gen"])
        ckpt.set_rng_state(state["rng"])
        self.step = int(state["step"])

    # -- one optimizer step ----------------------------------------------------------------------
    def _labels(self, y: torch.Tensor) -> torch.Tensor | None:
        if not self.num_classes:
            return None
        drop = torch.rand(y.shape, generator=self.gen, device=self.device) < self.cfg.model.label_dropout
        return torch.where(drop, torch.full_like(y, self.num_classes), y)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        accum = self.cfg.train.grad_accum
        total = torch.zeros((), device=self.device)
        for _ in range(accum):
            x0, y = next(self.data)
            loss, _ = self.objective(self.model, x0, self._labels(y), self.gen)
            (loss / accum).backward()
            total += loss.detach() / accum
        params = [p for g in self.opt.param_groups for p in g["params"]]
        clip = self.cfg.optim.grad_clip
        gnorm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)
        self.opt.step()
        self.lr_sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.ema.update_parameters(self.model)
        self.step += 1
        if self.step % self.cfg.diffusion.stats_every == 0:
            self.objective.sync_stats()
        return total, gnorm.detach()

    # -- the run ---------------------------------------------------------------------------------
    def fit(self, log: MetricLogger | None = None) -> dict:
        tc = self.cfg.train
        log = log or MetricLogger(self.run_dir)
        (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))
        if self.step == 0:
            log.log(0, params=count_params(self.model), images=0)
        acc_loss, acc_gn, n_acc, t0 = torch.zeros((), device=self.device), torch.zeros((), device=self.device), 0, time.time()
        bar = tqdm(total=tc.steps, initial=self.step, desc="train", unit="step", disable=not tc.progress, dynamic_ncols=True)
        try:
            while self.step < tc.steps:
                loss, gnorm = self.train_step()
                acc_loss += loss
                acc_gn += gnorm
                n_acc += 1
                bar.update(1)
                if self.step % tc.log_every == 0 or self.step == tc.steps:
                    dt = time.time() - t0
                    mean_loss = (acc_loss / n_acc).item()  # the one host sync per log interval
                    if not math.isfinite(mean_loss):
                        raise FloatingPointError(f"loss became {mean_loss} at step {self.step}")
                    buckets = self.objective.stats.bucketed(10, "raw") if self.objective.stats else None
                    log.log(self.step, images=self.step * self.images_per_step, loss=mean_loss,
                            grad_norm=(acc_gn / n_acc).item(), lr=self.lr_sched.get_last_lr()[0],
                            sec_per_step=dt / n_acc, images_per_sec=n_acc * self.images_per_step / dt,
                            loss_by_t_bucket=None if buckets is None else buckets["mean"])
                    bar.set_postfix(loss=f"{mean_loss:.4f}")
                    acc_loss.zero_(), acc_gn.zero_()
                    n_acc, t0 = 0, time.time()
                if tc.ckpt_every and self.step % tc.ckpt_every == 0:
                    self.save()
                if self.cfg.eval.every and self.step % self.cfg.eval.every == 0 and self.step < tc.steps:
                    self.evaluate(log)
        except BaseException as e:
            bar.close()
            # Nothing lost: Ctrl-C saves a resumable last.pt; an error (say a NaN loss) saves crash.pt
            # for inspection and keeps the last good last.pt.
            self.save("last.pt" if isinstance(e, KeyboardInterrupt) else "crash.pt")
            log.close()
            raise
        bar.close()
        self.save("last.pt")  # before the final sync, so that a resumed run continues exactly
        self.objective.sync_stats()
        summary = self.finish(log)
        log.close()
        return summary

    # -- end of run: samples and plots -----------------------------------------------------------
    @torch.no_grad()
    def generate(self, n: int, labels: torch.Tensor | None = None, seed: int = 0, steps: int | None = None,
                 method: str | None = None, guidance: float | None = None, ema: bool = True,
                 progress: bool | None = None, eta: float | None = None) -> torch.Tensor:
        """n samples from the EMA weights (or the raw ones), settings from cfg.sample unless given."""
        sc = self.cfg.sample
        net = (self.ema.module if ema else self.model).eval()
        shape = (n, self.info.channels) + ((self.info.image_size,) * 2 if self.info.image_size else ())
        chunk = 1024  # bounded memory for large n; chunk i uses seed + i, so results do not depend on n
        try:
            outs = []
            for i, lo in enumerate(range(0, n, chunk)):
                g = torch.Generator(self.device).manual_seed(seed + i)
                m = min(chunk, n - lo)
                outs.append(sample(net, self.schedule, self.cfg.diffusion.prediction, (m,) + shape[1:],
                                   steps=min(steps or sc.steps, self.schedule.T), method=method or sc.method,
                                   eta=sc.eta if eta is None else eta, labels=None if labels is None else labels[lo:lo + m],
                                   guidance=sc.guidance if guidance is None else guidance, null_label=self.num_classes,
                                   clip_x0=1.0 if self.info.image_size else None, generator=g, device=self.device,
                                   progress=self.cfg.train.progress if progress is None else progress))
            return torch.cat(outs)
        finally:
            self.model.train()

    def evaluate(self, log: MetricLogger) -> dict:
        from .evaluate import run_evaluation

        metrics = run_evaluation(self)
        log.log(self.step, images=self.step * self.images_per_step, **{f"eval/{k}": v for k, v in metrics.items()})
        return metrics

    def save_samples(self, path: Path, n: int) -> torch.Tensor:
        """A grid of n samples (one column per class when conditional), or a scatter for 2-D data."""
        if self.info.image_size:
            labels = torch.arange(n, device=self.device) % self.num_classes if self.num_classes else None
            x = self.generate(n, labels)
            nrow = self.num_classes or int(math.sqrt(n))
            if self.cfg.data.name == "latents":  # decode elsewhere; the grid shows channel 0
                torch.save(x.cpu(), path.with_suffix(".pt"))
                shown = x[:, :1] / x[:, :1].abs().amax().clamp_min(1e-8)
            else:
                shown = x
            big = F.interpolate(shown, scale_factor=max(1, 64 // self.info.image_size), mode="nearest")
            save_image(big * 0.5 + 0.5, path, nrow=nrow, padding=2, pad_value=1.0)
        else:
            x = self.generate(max(n, 2000))
            plots.plot_points(path, x, self.data.x[:2000], title=self.cfg.data.name)
        return x

    def finish(self, log: MetricLogger) -> dict:
        cfg, out = self.cfg, {"steps": self.step, "images": self.step * self.images_per_step}
        if cfg.sample.num:
            x = self.save_samples(self.run_dir / "samples.png", cfg.sample.num)
            if not self.info.image_size:
                data = self.data.x[:2000]
                out["sample_mean"], out["sample_std"] = x.mean(0).tolist(), x.std(0).tolist()
                out["data_mean"], out["data_std"] = data.mean(0).tolist(), data.std(0).tolist()
        if cfg.eval.num_samples or cfg.eval.bpd:
            out["eval"] = self.evaluate(log)
        obj = self.objective
        if obj.stats is not None:
            plots.plot_timesteps(self.run_dir / "timesteps.png", obj.stats, obj.probs(), obj.effective_weight(),
                                 title=f"{cfg.diffusion.prediction} · {cfg.diffusion.weighting} · {cfg.diffusion.sampler}")
        rows = read_jsonl(self.run_dir / "metrics.jsonl")
        plots.plot_loss_curve(self.run_dir / "loss.png", rows)
        plots.plot_eval_curves(self.run_dir / "eval.png", rows)
        (self.run_dir / "summary.json").write_text(json.dumps(out, indent=2))
        return out

    @classmethod
    def from_run(cls, path: str | Path) -> "Trainer":
        """A trainer restored from a run directory or a checkpoint file (for sample/eval/report)."""
        path = Path(path)
        ckpt_path = path / "last.pt" if path.is_dir() else path
        state = ckpt.load(ckpt_path)
        cfg = OmegaConf.merge(OmegaConf.structured(Config), state["config"])
        cfg.run_dir = str(ckpt_path.parent)
        cfg.train.progress = False
        tr = cls(cfg)
        tr.load(ckpt_path)
        return tr


def train(cfg: DictConfig, resume: bool = False) -> dict:
    trainer = Trainer(cfg)
    last = trainer.run_dir / "last.pt"
    if resume:
        if not last.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {last}")
        trainer.load(last)
    return trainer.fit()
