"""The training loop: AdamW with warm-up, EMA, gradient clipping and accumulation, seeded everything,
atomic checkpoints with exact resume, JSONL + TensorBoard metrics, a progress bar, and at the end a
sample grid and per-timestep plots.

Progress is counted in images as well as steps (EDM2). The step itself never syncs with the host:
losses are accumulated on the device and read once per `train.log_every` steps.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torchvision.utils import save_image
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import distributed as dist_utils
from . import plots
from .config import Config
from .ema import EMA
from .data import build_data
from .diffusion import DiffusionObjective, schedule as make_schedule
from .logger import MetricLogger, read_jsonl
from .models import build_model, count_params, forward_flops
from .parallel import parallelize
from .sample import sample

# Sections that must match for a checkpoint to be resumed (the rest may change, e.g. train.steps).
RESUME_MUST_MATCH = ("data", "model", "diffusion")


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


class _NoLog:
    """What ranks other than 0 log to."""

    def log(self, *args, **kwargs):
        pass

    def close(self):
        pass


def _optimizer(params, o, device: torch.device):
    """AdamW: apex's FusedAdam on CUDA where apex is installed (or asked for), else torch's fused
    kernel on CUDA and its foreach path on CPU."""
    kw = dict(lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    if o.impl == "apex" or (o.impl == "auto" and device.type == "cuda"):
        try:
            from apex.optimizers import FusedAdam

            return FusedAdam(params, adam_w_mode=True, **kw)
        except ImportError:
            if o.impl == "apex":
                raise ValueError("optim.impl=apex but apex is not installed") from None
    if o.impl == "torch" or o.impl == "auto":
        return torch.optim.AdamW(params, fused=device.type == "cuda", foreach=device.type != "cuda", **kw)
    raise ValueError(f"bad value for 'optim.impl': {o.impl!r}")


class Trainer:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        tc = cfg.train
        if tc.threads > 0:
            torch.set_num_threads(tc.threads)
        want_cuda = tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())
        if want_cuda and not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but no CUDA device is available")
        self.dist = dist_utils.init(tc.device)
        rank, world = self.dist.rank, self.dist.world_size
        self.device = torch.device(f"cuda:{self.dist.local_rank}" if want_cuda else "cpu")
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(tc.seed)  # the same initial weights on every rank

        d = cfg.data
        self.data, self.info = build_data(d.name, batch_size=d.batch_size, seed=tc.seed, image_size=d.image_size,
                                          root=d.root, channels=d.channels, holdout=d.holdout, device=self.device,
                                          num_workers=d.num_workers, backend=d.backend, manifest=d.manifest,
                                          crop=d.crop, flip=d.flip, rank=rank, world_size=world)
        self.num_classes = self.info.num_classes if cfg.model.class_conditional else 0
        model_kw = dict(in_channels=self.info.channels, image_size=self.info.image_size,
                        num_classes=self.num_classes, **cfg.model.args)
        self.model = build_model(cfg.model.name, **model_kw).to(self.device)
        self.num_params = count_params(self.model)
        pc = cfg.parallel
        strategy = pc.strategy if pc.strategy != "auto" else ("fsdp" if world > 1 else "none")
        if strategy == "none" and world > 1:
            raise ValueError(f"parallel.strategy=none cannot train on {world} processes (use fsdp or ddp)")
        if world > 1 and cfg.diffusion.learned_weighting:
            raise ValueError("diffusion.learned_weighting is single-process for now (its weights are not synced)")
        self.model = parallelize(self.model, strategy, pc.ac, pc.compile, pc.precision, self.device)
        self.net = getattr(self.model, "module", self.model) if strategy == "ddp" else self.model  # for sampling
        df = cfg.diffusion
        self.schedule = make_schedule(df.schedule, df.T, df.zero_terminal_snr).to(self.device)
        self.objective = DiffusionObjective(
            self.schedule, df.prediction, df.weighting, df.sampler,
            weighting_args=dict(df.weighting_args), sampler_args=dict(df.sampler_args),
            learned_weighting=df.learned_weighting, backend=df.backend,
            seed=tc.seed + 1_000_003 * rank).to(self.device)  # a different noise stream per rank
        self.objective.sampler.set_partition(rank, world, tc.grad_accum)
        o = cfg.optim
        self.opt = _optimizer(list(self.model.parameters()) + list(self.objective.parameters()), o, self.device)
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
        self.ema = EMA(self.model, o.ema_decay, o.ema_warmup)
        # timesteps and label dropout; per rank, so that stratified strata are filled independently
        self.gen = torch.Generator(self.device).manual_seed(tc.seed + 1 + 7919 * rank)
        self.step, self.images = 0, 0  # progress in images too (EDM2): it survives a change of world size
        self.images_per_step = d.batch_size * tc.grad_accum * world
        peak = dist_utils.device_peak_flops()
        self.flops_per_image = 3 * forward_flops(cfg.model.name, **model_kw) if peak else None
        self.peak_flops = peak * world if peak else None

    # -- checkpoints -----------------------------------------------------------------------------
    def _extra(self) -> dict:
        return {"step": self.step, "config": OmegaConf.to_container(self.cfg), "lr_sched": self.lr_sched.state_dict(),
                "objective_extra": self.objective.extra_state(), "data": self.data.state_dict(),
                "ranks": dist_utils.all_gather_objects({"gen": self.gen.get_state(), "rng": ckpt.rng_state()}),
                "world_size": self.dist.world_size, "ema_n": self.ema.n, "images": self.images}

    def _optimizer_state(self, full: bool) -> dict:
        """Keyed by parameter names (reshardable), unless the optimizer also holds the objective's
        learned weighting, which is not part of the model (single-process only)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if any(True for _ in self.objective.parameters()):
            return self.opt.state_dict()
        return get_optimizer_state_dict(self.model, self.opt, options=StateDictOptions(full_state_dict=full))

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {**self._extra(), "model": get_model_state_dict(self.model), "ema": self.ema.state_dict(),
                "optimizer": self._optimizer_state(full=True), "objective": self.objective.state_dict()}

    def save(self, name: str = "last.pt") -> Path:
        """One torch.save file in a single process; a sharded DCP checkpoint (RUN/dcp) across ranks."""
        if self.dist.world_size > 1:
            return self._save_dcp()
        return ckpt.save(self.run_dir / name, self.state_dict())

    def _dcp_state(self, extra: dict | None) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(self.model), "optim": self._optimizer_state(full=False),
                "ema": dict(zip(self.ema.names, self.ema.shadow)),
                "extra": ckpt.to_bytes(extra) if extra is not None else b""}

    def _save_dcp(self) -> Path:
        import shutil

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        final, tmp = self.run_dir / "dcp", self.run_dir / "dcp.tmp"
        if self.dist.is_main and tmp.exists():
            shutil.rmtree(tmp)
        dist.barrier()
        dcp.save(self._dcp_state(self._extra()), checkpoint_id=str(tmp))
        dist.barrier()
        if self.dist.is_main:  # replace the previous checkpoint only once the new one is complete
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        dist.barrier()
        return final

    def load(self, path: str | Path) -> None:
        """Resume from a torch.save file or a DCP folder, on this or another number of processes."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        path = Path(path)
        if path.is_dir():
            import torch.distributed.checkpoint as dcp

            state = self._dcp_state(None)
            dcp.load(state, checkpoint_id=str(path))
            extra = ckpt.from_bytes(state["extra"])
            model_sd, optim_sd, ema_sd, full = state["model"], state["optim"], state["ema"], False
        else:
            extra = ckpt.load(path, map_location="cpu")  # RNG states must stay CPU tensors
            model_sd, optim_sd, ema_sd, full = extra["model"], extra["optimizer"], extra["ema"]["shadow"], True
        mine = OmegaConf.to_container(self.cfg)
        for section in RESUME_MUST_MATCH:
            diff = _config_diff(extra["config"][section], mine[section], section + ".")
            if diff:
                raise ValueError(f"cannot resume {path}: config key '{diff}' differs from the checkpoint")
        opts = StateDictOptions(full_state_dict=full and self.dist.world_size > 1)
        set_model_state_dict(self.model, model_sd, options=opts)
        if optim_sd["param_groups"] and isinstance(optim_sd["param_groups"][0]["params"][0], int):
            self.opt.load_state_dict(optim_sd)  # positional (with a learned weighting)
        else:
            set_optimizer_state_dict(self.model, self.opt, optim_sd, options=opts)
        self.ema.load_state_dict({"n": extra["ema_n"], "shadow": ema_sd})
        if "objective" in extra:
            self.objective.load_state_dict(extra["objective"])
        self.lr_sched.load_state_dict(extra["lr_sched"])
        self.objective.load_extra_state(extra["objective_extra"])
        self.data.load_state_dict(extra["data"])
        ranks = extra["ranks"]
        if len(ranks) == self.dist.world_size:  # the same layout: continue every rank's streams exactly
            self.gen.set_state(ranks[self.dist.rank]["gen"])
            ckpt.set_rng_state(ranks[self.dist.rank]["rng"])
        else:  # another world size: fresh per-rank streams, derived from the step
            self.gen.manual_seed(self.cfg.train.seed + 1 + 7919 * self.dist.rank + 104729 * int(extra["step"]))
        self.step = int(extra["step"])
        self.images = int(extra.get("images", self.step * self.images_per_step))

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
        clip = self.cfg.optim.grad_clip
        gnorm = torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), clip if clip > 0 else math.inf)
        if isinstance(gnorm, torch.Tensor) and hasattr(gnorm, "full_tensor"):
            gnorm = gnorm.full_tensor()  # a DTensor under FSDP
        self.opt.step()
        self.lr_sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.ema.update(self.model)
        self.step += 1
        self.images += self.images_per_step
        if self.step % self.cfg.diffusion.stats_every == 0:
            self.objective.sync_stats()
        return total, gnorm.detach()

    # -- the run ---------------------------------------------------------------------------------
    def fit(self, log: MetricLogger | None = None) -> dict:
        tc, main = self.cfg.train, self.dist.is_main
        log = log or (MetricLogger(self.run_dir) if main else _NoLog())
        if main:
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))
        if self.step == 0:
            log.log(0, params=self.num_params, images=0, world_size=self.dist.world_size)
        acc_loss, acc_gn, n_acc, t0 = torch.zeros((), device=self.device), torch.zeros((), device=self.device), 0, time.time()
        bar = tqdm(total=tc.steps, initial=self.step, desc="train", unit="step", disable=not (tc.progress and main),
                   dynamic_ncols=True)
        try:
            while self.step < tc.steps:
                loss, gnorm = self.train_step()
                acc_loss += loss
                acc_gn += gnorm
                n_acc += 1
                bar.update(1)
                if self.step % tc.log_every == 0 or self.step == tc.steps:
                    dt = time.time() - t0
                    # the one host sync per log interval (and one all-reduce across ranks)
                    mean_loss = dist_utils.mean_across_ranks(acc_loss / n_acc).item()
                    if not math.isfinite(mean_loss):
                        raise FloatingPointError(f"loss became {mean_loss} at step {self.step}")
                    buckets = self.objective.stats.bucketed(10, "raw") if self.objective.stats else None
                    img_s = n_acc * self.images_per_step / dt
                    log.log(self.step, images=self.images, loss=mean_loss,
                            grad_norm=(acc_gn / n_acc).item(), lr=self.lr_sched.get_last_lr()[0],
                            sec_per_step=dt / n_acc, images_per_sec=img_s,
                            mfu=img_s * self.flops_per_image / self.peak_flops if self.peak_flops else None,
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
            # for inspection and keeps the last good last.pt. (Across ranks a collective save could
            # hang on a rank that died, so there the last periodic checkpoint is what resumes.)
            if self.dist.world_size == 1:
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
        net = self.net.eval()
        shape = (n, self.info.channels) + ((self.info.image_size,) * 2 if self.info.image_size else ())
        chunk = 1024  # bounded memory for large n; chunk i uses seed + i, so results do not depend on n
        # Every rank samples the same images in lockstep (FSDP gathers weights inside each forward).
        try:
            outs = []
            ctx = self.ema.applied(self.model) if ema else contextlib.nullcontext()
            ctx.__enter__()
            for i, lo in enumerate(range(0, n, chunk)):
                g = torch.Generator(self.device).manual_seed(seed + i)
                m = min(chunk, n - lo)
                outs.append(sample(net, self.schedule, self.cfg.diffusion.prediction, (m,) + shape[1:],
                                   steps=min(steps or sc.steps, self.schedule.T), method=method or sc.method,
                                   eta=sc.eta if eta is None else eta, labels=None if labels is None else labels[lo:lo + m],
                                   guidance=sc.guidance if guidance is None else guidance, null_label=self.num_classes,
                                   clip_x0=1.0 if self.info.image_size else None, generator=g, device=self.device,
                                   progress=(self.cfg.train.progress if progress is None else progress)
                                   and self.dist.is_main))
            ctx.__exit__(None, None, None)
            return torch.cat(outs)
        finally:
            self.model.train()

    def evaluate(self, log: MetricLogger) -> dict:
        from .evaluate import run_evaluation

        metrics = run_evaluation(self)  # on every rank (the forwards are collective under FSDP)
        log.log(self.step, images=self.images, **{f"eval/{k}": v for k, v in metrics.items()})
        return metrics

    def save_samples(self, path: Path, n: int) -> torch.Tensor:
        """A grid of n samples (one column per class when conditional), or a scatter for 2-D data."""
        if self.info.image_size:
            labels = torch.arange(n, device=self.device) % self.num_classes if self.num_classes else None
            x = self.generate(n, labels)
            nrow = self.num_classes or int(math.sqrt(n))
            if not self.dist.is_main:
                return x
            if self.cfg.data.name == "latents":  # decode elsewhere; the grid shows channel 0
                torch.save(x.cpu(), path.with_suffix(".pt"))
                shown = x[:, :1] / x[:, :1].abs().amax().clamp_min(1e-8)
            else:
                shown = x
            big = F.interpolate(shown, scale_factor=max(1, 64 // self.info.image_size), mode="nearest")
            save_image(big * 0.5 + 0.5, path, nrow=nrow, padding=2, pad_value=1.0)
        else:
            x = self.generate(max(n, 2000))
            if self.dist.is_main:
                plots.plot_points(path, x, self.data.x[:2000], title=self.cfg.data.name)
        return x

    def finish(self, log: MetricLogger) -> dict:
        cfg, out = self.cfg, {"steps": self.step, "images": self.images}
        if cfg.sample.num:
            x = self.save_samples(self.run_dir / "samples.png", cfg.sample.num)
            if not self.info.image_size:
                data = self.data.x[:2000]
                out["sample_mean"], out["sample_std"] = x.mean(0).tolist(), x.std(0).tolist()
                out["data_mean"], out["data_std"] = data.mean(0).tolist(), data.std(0).tolist()
        if cfg.eval.num_samples or cfg.eval.bpd:
            out["eval"] = self.evaluate(log)
        if not self.dist.is_main:
            return out
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
        ckpt_path = (latest_checkpoint(path) or path / "last.pt") if path.is_dir() and not (path / ".metadata").exists() else path
        if ckpt_path.is_dir():  # a DCP folder: its config is inside the small extra blob
            import torch.distributed.checkpoint as dcp

            state = {"extra": b""}
            dcp.load(state, checkpoint_id=str(ckpt_path))
            saved = ckpt.from_bytes(state["extra"])["config"]
        else:
            saved = ckpt.load(ckpt_path)["config"]
        cfg = OmegaConf.merge(OmegaConf.structured(Config), saved)
        cfg.run_dir = str(ckpt_path.parent)
        cfg.train.progress = False
        tr = cls(cfg)
        tr.load(ckpt_path)
        return tr


def latest_checkpoint(run_dir: Path) -> Path | None:
    """RUN/last.pt (one process) or RUN/dcp (several), whichever was written last."""
    found = [p for p in (run_dir / "last.pt", run_dir / "dcp") if p.exists() and (p.is_file() or (p / ".metadata").is_file())]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def train(cfg: DictConfig, resume: bool = False) -> dict:
    trainer = Trainer(cfg)
    if resume:
        last = latest_checkpoint(trainer.run_dir)
        if last is None:
            raise FileNotFoundError(f"--resume: no checkpoint at {trainer.run_dir / 'last.pt'} or {trainer.run_dir / 'dcp'}")
        trainer.load(last)
    return trainer.fit()
