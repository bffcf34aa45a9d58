"""The trainer: a model bundle (bundle.py) plus data, optimizer and the step loop.

Reads top to bottom: set-up (process group, data, network, parallelism, objective, optimizer),
checkpoint state out and in, one optimizer step, the run loop, the end of the run. Progress is
counted in images as well as steps (EDM2). The step never syncs with the host: losses, gradient
norms and skipped-step counters stay on the device and are read once per `train.log_every` steps
(the run of skipped steps every min(train.max_nonfinite, log_every) steps); a non-finite step is
skipped on the device (fused AdamW's `found_inf`, the EMA weight set to 0).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import distributed as dist_utils
from . import graphs, plots, seeds
from .bundle import DataSpec, ModelBundle, build_network, build_objective
from .config import plain
from .data import build_data
from .diffusion.interference import InterferenceDiagnostic
from .diffusion.lookahead import LookAheadContext, lookaheads
from .diffusion.variation import loss_cv
from .errors import UserError
from .evaluate import EvalSettings, reference_for, run_evaluation
from .logger import MetricLogger
from .models import count_params, forward_flops
from .optim import make_optimizer, skip_if_not_finite
from .parallel import parallelize
from .precision import resolve as resolve_precision
from .stopping import GracefulStop

class _NoLog:
    """What ranks other than 0 log to."""

    def log(self, *args, **kwargs):
        pass

    def close(self):
        pass


class Trainer:
    # -- set-up ------------------------------------------------------------------------------------
    def __init__(self, cfg: DictConfig, *, resume: bool = False, restart: bool = False):
        self.cfg = cfg
        tc = cfg.train
        if tc.threads > 0:
            torch.set_num_threads(tc.threads)
        want_cuda = tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())
        if want_cuda and not torch.cuda.is_available():
            raise UserError("train.device=cuda but no CUDA device is available")
        self.dist = dist_utils.init(tc.device)
        rank, world = self.dist.rank, self.dist.world_size
        self.device = torch.device(f"cuda:{self.dist.local_rank}" if want_cuda else "cpu")
        self.run_dir = Path(cfg.run_dir)
        self.checkpoints = ckpt.CheckpointManager(self.run_dir, self.dist)
        self.lock = self._claim_run_dir(resume, restart) if self.dist.is_main else None
        try:
            self._set_up(cfg, rank, world, want_cuda)
        except BaseException:
            self.close()  # a failed set-up leaves the run directory free
            raise

    def _set_up(self, cfg, rank: int, world: int, want_cuda: bool) -> None:
        tc = cfg.train
        d = cfg.data
        self.data, info = build_data(d.name, batch_size=d.batch_size, seed=tc.seed, image_size=d.image_size,
                                     root=d.root, channels=d.channels, holdout=d.holdout, device=self.device,
                                     num_workers=d.num_workers, backend=d.backend, manifest=d.manifest,
                                     crop=d.crop, flip=d.flip, rank=rank, world_size=world)
        self.spec = DataSpec(d.name, info.channels, info.image_size,
                             info.num_classes if cfg.model.class_conditional else 0, cfg.model.label_dropout)
        with torch.random.fork_rng(devices=[]):  # the same initial weights on every rank
            torch.manual_seed(seeds.derive(tc.seed, "weights"))
            net = build_network(cfg, self.spec).to(self.device)
        self.num_params = count_params(net)
        pc = cfg.parallel
        strategy = pc.strategy if pc.strategy != "auto" else ("fsdp" if world > 1 else "none")
        if strategy == "none" and world > 1:
            raise ValueError(f"parallel.strategy=none cannot train on {world} processes (use fsdp or ddp)")
        self.precision = resolve_precision(pc.precision, self.device, strategy)
        self.model = parallelize(net, strategy, pc.ac, pc.compile, self.precision.name, self.device, pc.compile_mode,
                                 pc.channels_last)
        self.objective = build_objective(cfg, rank).to(self.device)
        self.objective.input_dtype = self.precision.input_dtype
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision.scaler else None
        self.bundle = ModelBundle.build(cfg, self.spec, self.device, net=self.model, objective=self.objective)
        self.ema = self.bundle.ema
        self.objective.sampler.set_partition(rank, world, tc.grad_accum)
        dg = cfg.diagnostics
        self.interference = None
        if dg.interference_every:
            self.interference = InterferenceDiagnostic(self.objective.T, dg.interference_every, dg.buckets,
                                                       dg.probe_size, seeds.derive(tc.seed, "probe"))
        self.hooks = lookaheads(self.objective.sampler, self.interference)
        self.opt = make_optimizer(list(self.model.parameters()), cfg.optim, self.device)
        o = cfg.optim
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
        # timesteps and label dropout: per rank, so that stratified strata are filled independently
        self.gen = torch.Generator(self.device).manual_seed(seeds.derive(tc.seed, "timesteps", rank))
        self.step, self.images = 0, 0  # progress in images too (EDM2): it survives a change of world size
        self.images_per_step = d.batch_size * tc.grad_accum * world
        self.skipped = torch.zeros((), dtype=torch.long, device=self.device)      # non-finite steps in all
        self.skipped_run = torch.zeros((), dtype=torch.long, device=self.device)  # ... and in a row
        self.graph = None
        if tc.cuda_graph:
            reason = graphs.unsupported(self)
            if reason:
                if self.dist.is_main:
                    print(f"fasttrain: train.cuda_graph: keeping the eager step ({reason})", file=sys.stderr)
            else:
                self.graph = graphs.GraphedStep(self)
        peak = dist_utils.device_peak_flops()
        self.flops_per_image = 3 * forward_flops(cfg.model.name, in_channels=self.spec.channels,
                                                 image_size=self.spec.image_size, num_classes=self.spec.num_classes,
                                                 **plain(cfg.model.args)) if peak else None
        self.peak_flops = peak * world if peak else None

    def _claim_run_dir(self, resume: bool, restart: bool):
        """One trainer per run directory, and a fresh run never overwrites an earlier one."""
        if resume and ckpt.latest(self.run_dir) is None:  # before anything is created there
            raise _no_checkpoint(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock = ckpt.RunLock(self.run_dir)
        if resume:
            return lock
        earlier = [p.name for p in (self.run_dir / "last.pt", self.run_dir / "dcp", self.run_dir / "crash.pt",
                                    self.run_dir / "metrics.jsonl") if p.exists()]
        if earlier and restart:
            moved = ckpt.archive_previous_run(self.run_dir)
            print(f"fasttrain: moved the earlier run to {moved}", file=sys.stderr)
        elif earlier:
            lock.release()
            how = ("continue it with --resume, or " if ckpt.latest(self.run_dir) else "it has no checkpoint to "
                   "continue from, so ")
            raise UserError(f"{self.run_dir} already holds a run ({', '.join(earlier)}): {how}start over with "
                            f"--restart (which moves it to {self.run_dir}/previous-N/)")
        return lock

    # -- checkpoints (the manager in checkpoint.py owns formats and contents) -----------------------
    def save(self, name: str = "last.pt") -> Path | None:
        return self.checkpoints.save(self, name)

    def restore(self, path) -> None:
        """Resume from last.pt or a DCP folder, on this or another number of processes."""
        changed = self.checkpoints.restore(self, path)
        if changed and self.dist.is_main:
            print(f"fasttrain: resume applies the changed {', '.join(changed)}", file=sys.stderr)

    # -- one optimizer step --------------------------------------------------------------------------
    def _labels(self, y: torch.Tensor) -> torch.Tensor | None:
        if not self.spec.num_classes:
            return None
        drop = torch.rand(y.shape, generator=self.gen, device=self.device) < self.cfg.model.label_dropout
        return torch.where(drop, torch.full_like(y, self.spec.num_classes), y)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graph is not None:  # the whole step replayed from one CUDA graph (graphs.py)
            total, gnorm = self.graph(next(self.data))
            if self.interference is not None and self.interference.due(self.step):  # outside the graph, with
                ctx = LookAheadContext(self.model, self.objective, self.graph.x0, self.graph.labels, self.step, 0, 1,
                                       lr=float(self.graph.lr), optimizer=self.opt)  # the step's labels and lr
                with self.precision.context():
                    self.interference.after_update(ctx)
            self.lr_sched.step()
            self.graph.sync_lr()
            return self._after_step(total, gnorm)
        accum = self.cfg.train.grad_accum
        total = torch.zeros((), device=self.device)
        for m in range(accum):
            x0, y = next(self.data)
            labels = self._labels(y)
            if m == 0:
                first = (x0, labels)
            with self.precision.context():
                loss, _ = self.objective(self.model, x0, labels, self.gen)
            scaled = loss / accum
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += loss.detach() / accum
        if self.scaler:
            self.scaler.unscale_(self.opt)  # true gradients before clipping (fp16)
        ctx = LookAheadContext(self.model, self.objective, *first, self.step, self.dist.rank, self.dist.world_size,
                               lr=float(self.opt.param_groups[0]["lr"]), optimizer=self.opt)
        gnorm = self.update(total, [h for h in self.hooks if h.due(self.step)], ctx)
        return self._after_step(total, gnorm)

    def update(self, total: torch.Tensor, due=(), ctx=None, ema_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Everything after the backward, shared by the eager step and the CUDA-graph body (graphs.py,
        which passes no hooks and a device EMA weight, and steps the scheduler outside the graph):
        clip, the finite check, the look-ahead hooks around the optimizer step (or its skip), the EMA
        and the skipped-step counters. Returns the gradient norm."""
        clip = self.cfg.optim.grad_clip
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else math.inf)
        if hasattr(gnorm, "full_tensor"):
            gnorm = gnorm.full_tensor()  # a DTensor under FSDP
        finite = torch.isfinite(total) & torch.isfinite(gnorm)
        for h in due:  # the look-ahead brackets the optimizer step, not a micro-step
            with self.precision.context():  # probes see the model as the forward does
                h.before_update(ctx)
        if self.scaler:  # fp16: the scaler skips an overflowing step itself (found_inf) and adapts its scale
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            skip_if_not_finite(self.opt, finite)
            self.opt.step()
        if ema_weight is None:  # eager: the scheduler and the gradients' reset belong to the step
            self.lr_sched.step()
            self.opt.zero_grad(set_to_none=True)
        for h in due:  # after the update, gradients cleared: a hook may run its own backward
            with self.precision.context():
                h.after_update(ctx)
        self.ema.update(self.model, applied=finite, weight=ema_weight)
        self.skipped += (~finite).long()
        self.skipped_run.copy_((self.skipped_run + 1) * (~finite).long())
        return gnorm.detach()

    def _after_step(self, total, gnorm):
        self.step += 1
        self.images += self.images_per_step
        if self.step % self.cfg.diffusion.stats_every == 0:
            self.objective.sync_stats()
        return total, gnorm.detach()

    # -- the run ---------------------------------------------------------------------------------------
    def fit(self) -> dict:
        tc, main = self.cfg.train, self.dist.is_main
        log = MetricLogger(self.run_dir, purge_step=self.step) if main else _NoLog()
        if main:
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))  # the truth, resumed or not
        if self.step == 0:
            log.log(0, params=self.num_params, images=0, world_size=self.dist.world_size)
        acc = torch.zeros(3, device=self.device)  # Σ loss, Σ grad norm, count over the finite (not skipped) steps
        one = torch.ones((), device=self.device)
        n_acc, t0 = 0, time.time()
        bar = tqdm(total=tc.steps, initial=self.step, desc="train", unit="step", disable=not (tc.progress and main),
                   dynamic_ncols=True)
        try:
            with GracefulStop(self.dist.world_size) as stop:
                while self.step < tc.steps:
                    loss, gnorm = self.train_step()
                    ok = torch.isfinite(loss) & torch.isfinite(gnorm)
                    acc += torch.stack([loss.float(), gnorm.float(), one]).where(ok, 0.0)
                    n_acc += 1
                    bar.update(1)
                    if self.step % tc.log_every == 0 or self.step == tc.steps:
                        self._log(log, bar, acc, n_acc, time.time() - t0)
                        acc.zero_()
                        n_acc, t0 = 0, time.time()
                    if tc.max_nonfinite and self.step % min(tc.max_nonfinite, tc.log_every) == 0:
                        self._check_nonfinite()
                    paused = time.time()  # checkpoints and evaluations do not count as training time
                    if tc.ckpt_every and self.step % tc.ckpt_every == 0:
                        self._save_if_good()
                    if self.cfg.eval.every and self.step % self.cfg.eval.every == 0 and self.step < tc.steps:
                        self.evaluate(log)
                    t0 += time.time() - paused
                    if stop.should_stop():
                        self._save_if_good()
                        raise KeyboardInterrupt
        except BaseException as e:
            bar.close()
            # Nothing lost: a signal saves a resumable last.pt (above, at a step boundary); an error
            # saves crash.pt for inspection and keeps the last good last.pt. (Across ranks a collective
            # save could hang on a rank that died, so there the last periodic checkpoint is what resumes.)
            if not isinstance(e, KeyboardInterrupt) and self.dist.world_size == 1:
                _report_failure("crash.pt not written", lambda: self.save("crash.pt"))
            _report_failure("the log was not closed cleanly", log.close)  # the original error is the one raised
            raise
        bar.close()
        self._save_if_good()  # before the final sync, so that a resumed run continues exactly
        self.objective.sync_stats()
        summary = self.finish(log)
        log.close()
        return summary

    def _log(self, log, bar, acc, n_acc, dt) -> None:
        # the one host sync per log interval (and one all-reduce across ranks); loss and grad norm are
        # means over the steps that were not skipped (None when all were)
        loss_sum, gn_sum, n_ok = dist_utils.mean_across_ranks(acc).tolist()
        mean_loss = loss_sum / n_ok if n_ok else None
        stats = self.objective.stats
        buckets = stats.bucketed(10, "raw") if stats is not None else None
        img_s = n_acc * self.images_per_step / dt
        extra = {}
        for h in self.hooks:  # look-ahead components: their own metrics, and the share of time they took
            extra.update(getattr(h, "metrics", lambda: {})())
        hook_s = sum(v for k, v in extra.items() if k.endswith("lookahead_s"))
        cv = None if stats is None else float(loss_cv(stats, self.cfg.diagnostics.loss_cv_buckets))
        log.log(self.step, images=self.images, loss=mean_loss, grad_norm=gn_sum / n_ok if n_ok else None,
                lr=self.lr_sched.get_last_lr()[0], sec_per_step=dt / n_acc, images_per_sec=img_s,
                mfu=img_s * self.flops_per_image / self.peak_flops if self.peak_flops else None,
                skipped_steps=int(self.skipped), loss_by_t_bucket=None if buckets is None else buckets["mean"],
                loss_cv=cv, lookahead_share=hook_s / dt if self.hooks else None, **extra)
        bar.set_postfix(loss=f"{mean_loss:.4f}" if mean_loss is not None else "skipped")

    def _check_nonfinite(self) -> None:
        run = int(self.skipped_run)
        if run >= self.cfg.train.max_nonfinite:  # fit's handler writes crash.pt
            kept = "the last good checkpoint is kept" if self.checkpoints.latest() else "no checkpoint had been written"
            raise FloatingPointError(f"stopped at step {self.step}: {run} non-finite steps in a row (skipped, weights "
                                     f"kept); {kept}, crash.pt holds this state (try a lower optim.lr)")

    def _weights_work(self) -> bool:
        """Finite weights whose output is finite on a probe (the last update could have made them
        huge but finite: the next step's loss would tell, the checkpoint must not wait for it)."""
        if not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            return False
        x = torch.zeros((2,) + self.spec.shape, device=self.device)
        t = torch.full((2,), self.objective.T // 2, device=self.device, dtype=torch.long)
        self.model.eval()
        try:
            with torch.no_grad():
                out = self.model(x, t)
        finally:
            self.model.train()
        return bool(torch.isfinite(out).all())

    def _save_if_good(self) -> None:
        """Never save over last.pt from a state whose last steps were not finite or whose weights are
        not (the previous last.pt stays the one to resume from)."""
        bad = int(self.skipped_run) > 0 or not self._weights_work()
        if bad:
            if self.dist.is_main:
                print(f"fasttrain: not saving at step {self.step}: the last steps were not finite "
                      f"(the previous last.pt is kept)", file=sys.stderr)
            return
        self.save()

    # -- the end of a run: samples, evaluation, plots -------------------------------------------------
    def reference(self):
        """The real data evaluations compare with: read (and for folders decoded) once per run."""
        if getattr(self, "_reference", None) is None:
            self._reference = reference_for(self.cfg, self.spec)
        return self._reference

    def evaluate(self, log) -> dict:
        metrics = run_evaluation(self.bundle, EvalSettings.from_config(self.cfg),
                                 self.reference())  # on every rank (FSDP forwards are collective)
        log.log(self.step, images=self.images, **{f"eval/{k}": v for k, v in metrics.items()})
        return metrics

    def finish(self, log) -> dict:
        cfg, out = self.cfg, {"steps": self.step, "images": self.images, "skipped_steps": int(self.skipped)}
        self.bundle.step, self.bundle.images = self.step, self.images
        if cfg.sample.num:
            labels = None
            if self.spec.num_classes and self.spec.image_size:
                labels = torch.arange(cfg.sample.num, device=self.device) % self.spec.num_classes
            n = cfg.sample.num if self.spec.image_size else max(cfg.sample.num, 2000)
            x = self.bundle.generate(n, labels, steps=cfg.sample.steps, solver=cfg.sample.solver,
                                     guidance=cfg.sample.guidance, eta=cfg.sample.eta, progress=cfg.train.progress)
            if self.dist.is_main:
                ref = self.reference().train if not self.spec.image_size else None
                plots.save_samples(self.run_dir / "samples.png", x, self.spec, reference=ref)
                if not self.spec.image_size:
                    out["sample_mean"], out["sample_std"] = x.mean(0).tolist(), x.std(0).tolist()
        if cfg.eval.num_samples or cfg.eval.bpd:
            out["eval"] = self.evaluate(log)
        if self.dist.is_main:
            plots.plot_run(self.run_dir, self.objective, title=f"{cfg.diffusion.prediction} · {cfg.diffusion.weighting}"
                           f" · {cfg.diffusion.sampler}", interference=self.interference)
            (self.run_dir / "summary.json").write_text(json.dumps(out, indent=2))
        return out

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()


def train(cfg: DictConfig, resume: bool = False, restart: bool = False) -> dict:
    trainer = Trainer(cfg, resume=resume, restart=restart)
    try:
        if resume:
            last = trainer.checkpoints.latest()
            if last is None:
                raise _no_checkpoint(trainer.run_dir)
            trainer.restore(last)
        return trainer.fit()
    finally:
        trainer.close()


def _no_checkpoint(run_dir: Path) -> FileNotFoundError:
    crash = "; crash.pt holds a failed run's state, not a resumable one: start over with --restart" \
        if (run_dir / "crash.pt").exists() else ""
    return FileNotFoundError(f"--resume: no checkpoint at {run_dir / 'last.pt'} or {run_dir / 'dcp'}{crash}")


def _report_failure(what: str, fn) -> None:
    """Run `fn` while another error is propagating: a failure of its own is one line on stderr, so that
    it does not replace the error the user needs to see."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        print(f"fasttrain: {what} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr)
