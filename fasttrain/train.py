"""The trainer: a model bundle (bundle.py) plus data, optimizer and the step loop.

Reads top to bottom: set-up (process group, data, network, parallelism, objective, optimizer),
checkpoint state out and in, one optimizer step, the run loop, the end of the run. Progress is
counted in images as well as steps (EDM2). The step never syncs with the host: losses, gradient
norms and skipped-step counters stay on the device and are read once per `train.log_every` steps
(the run of skipped steps every min(train.max_nonfinite, log_every) steps); a non-finite step is
skipped on the device (fused AdamW's `found_inf`, the EMA weight set to 0).
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import distributed as dist_utils
from . import graphs, plots, seeds
from .bundle import DataSpec, ModelBundle, build_network, build_objective
from .config import plain
from .cpu import set_threads
from .data import build_data
from .diffusion.interference import InterferenceDiagnostic
from .diffusion.lookahead import LookAheadContext
from .diffusion.variation import loss_cv
from .errors import DeviceError, InvalidInput, NonFiniteStop
from .evaluate import EvalSettings, reference_for, run_evaluation
from .logger import MetricLogger
from .models import count_params, forward_flops, weights_from_checkpoint
from .optim import apply_optimizer_config, make_optimizer, skip_if_not_finite
from .parallel import parallelize
from .precision import resolve as resolve_precision
from .stopping import GracefulStop
from .train_state import RankRNG, TrainState


class Trainer:
    # -- set-up ------------------------------------------------------------------------------------
    def __init__(self, cfg: DictConfig, *, resume: bool = False, restart: bool = False):
        self.cfg = cfg
        tc = cfg.train
        want_cuda = tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())
        set_threads(tc.threads, cpu_run=not want_cuda)
        if want_cuda and not torch.cuda.is_available():
            raise DeviceError("train.device=cuda but no CUDA device is available")
        self.dist = dist_utils.init(tc.device)
        rank, world = self.dist.rank, self.dist.world_size
        self.device = torch.device(f"cuda:{self.dist.local_rank}" if want_cuda else "cpu")
        self.run_dir = Path(cfg.run_dir)
        self.lock = ckpt.claim(self.run_dir, resume, restart) if self.dist.is_main else None
        try:
            # a resumed run's weights come from its checkpoint: a fine-tune's pretrained folder is not read
            with weights_from_checkpoint() if resume else contextlib.nullcontext():
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
                                     crop=d.crop, flip=d.flip, rank=rank, world_size=world, latent_norm=d.latent_norm)
        conditional = cfg.model.class_conditional and info.num_classes > 0
        self.spec = DataSpec(d.name, info.channels, info.image_size, info.num_classes if conditional else 0,
                             cfg.model.label_dropout, info.latents, info.class_names if conditional else None)
        with torch.random.fork_rng(devices=[]):  # the same initial weights on every rank
            torch.manual_seed(seeds.derive(tc.seed, "weights"))
            net = build_network(cfg, self.spec).to(self.device)
        self.num_params = count_params(net)
        pc = cfg.parallel
        strategy = pc.strategy if pc.strategy != "auto" else ("fsdp" if world > 1 else "none")
        if strategy == "none" and world > 1:
            raise InvalidInput(f"parallel.strategy=none cannot train on {world} processes (use fsdp or ddp)")
        self.precision = resolve_precision(pc.precision, self.device, strategy)
        self.model = parallelize(net, strategy, pc.ac, pc.compile, self.precision.name, self.device, pc.compile_mode,
                                 pc.channels_last)
        self.objective = build_objective(cfg, net, rank).to(self.device)
        self.objective.input_dtype = self.precision.input_dtype
        self.objective.set_partition(rank, world, tc.grad_accum)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision.scaler else None
        self.bundle = ModelBundle.build(cfg, self.spec, self.device, net=self.model)
        self.ema = self.bundle.ema
        dg = cfg.diagnostics
        self.interference = None
        if dg.interference_every:
            self.interference = InterferenceDiagnostic(self.objective.T, dg.interference_every, dg.buckets,
                                                       dg.probe_size, seeds.derive(tc.seed, "probe"))
        self.hooks = self.objective.lookaheads() + ([self.interference] if self.interference else [])
        self.opt = make_optimizer(list(self.model.parameters()), cfg.optim, self.device)
        o = cfg.optim
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
        # timesteps and label dropout: per rank, so that stratified strata are filled independently
        self.gen = torch.Generator(self.device).manual_seed(seeds.derive(tc.seed, "timesteps", rank))
        self.state = TrainState(self.device)
        self._skip_marks: list[tuple[int, int]] = []  # (step, skipped so far) at the non-finite checks
        self._eval_reference = None  # read once, at the first evaluation
        self.images_per_step = d.batch_size * tc.grad_accum * world
        self.checkpoints = ckpt.CheckpointManager(
            self.run_dir, self.dist, meta={"config": OmegaConf.to_container(cfg), "data_spec": asdict(self.spec)},
            model=self.model, optimizer=self.opt, ema=self.ema,
            states={"train": self.state, "lr_sched": self.lr_sched, "objective": self.objective, "data": self.data,
                    "interference": self.interference, "scaler": self.scaler},
            rank_states={"rng": RankRNG(self.gen, tc.seed, self.state), "objective": self.objective})
        self.step_fn = self._step  # or the same step replayed from one CUDA graph (graphs.py)
        if tc.cuda_graph:
            reason = graphs.unsupported(self.device, world, tc.grad_accum, self.objective, self.scaler, self.opt)
            if reason:
                if self.dist.is_main:
                    print(f"fasttrain: train.cuda_graph: keeping the eager step ({reason})", file=sys.stderr)
            else:
                self.step_fn = graphs.GraphedStep(self._step, self.opt, self.gen)
        peak = dist_utils.device_peak_flops()
        self.flops_per_image = 3 * forward_flops(cfg.model.name, in_channels=self.spec.channels,
                                                 image_size=self.spec.image_size, num_classes=self.spec.num_classes,
                                                 **plain(cfg.model.args)) if peak else None
        self.peak_flops = peak * world if peak else None

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def images(self) -> int:
        return self.state.images

    # -- checkpoints (checkpoint/: formats, run directory, the manager of the components above) ------
    def save(self, name: str = "last.pt") -> Path | None:
        return self.checkpoints.save(name)

    def restore(self, path) -> None:
        """Resume from last.pt or a DCP folder, on this or another number of processes; optimizer
        settings that the config changed are applied."""
        saved = self.checkpoints.restore(path)
        changed = apply_optimizer_config(self.opt, self.lr_sched, saved["optim"], plain(self.cfg.optim))
        if changed and self.dist.is_main:
            print(f"fasttrain: resume applies the changed {', '.join(changed)}", file=sys.stderr)

    # -- one optimizer step --------------------------------------------------------------------------
    def _labels(self, y: torch.Tensor) -> torch.Tensor | None:
        if not self.spec.num_classes:
            return None
        drop = torch.rand(y.shape, generator=self.gen, device=self.device) < self.cfg.model.label_dropout
        return torch.where(drop, torch.full_like(y, self.spec.num_classes), y)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: the step function (eager, or replayed from a CUDA graph) on the step's
        micro-batches, the look-ahead hooks around its optimizer update, the LR scheduler, counters."""
        due = [h for h in self.hooks if h.due(self.step)]
        lr = self.lr_sched.get_last_lr()[0]
        batches = [next(self.data) for _ in range(self.cfg.train.grad_accum)]
        if len(batches) == 1 and not any(h.acts_before for h in due):
            loss, gnorm, labels = self.step_fn(*batches[0])
        else:  # several micro-batches, or a hook that must see the gradients before the update
            loss, gnorm, labels = self._step(*[x for b in batches for x in b], before=due, lr=lr)
        if due:  # after the update, gradients cleared (the step function's last act)
            ctx = LookAheadContext(self.model, self.objective, batches[0][0], labels, self.step, self.dist.rank,
                                   self.dist.world_size, lr=float(lr), optimizer=self.opt)
            for h in due:
                with self.precision.context():  # probes see the model as the forward does
                    h.after_update(ctx)
            self.opt.zero_grad(set_to_none=True)  # a hook may have run its own backward
        self.lr_sched.step()
        self.state.step += 1
        self.state.images += self.images_per_step
        if self.step % self.cfg.diffusion.stats_every == 0:
            self.objective.sync_stats()
        return loss, gnorm

    def _step(self, *tensors: torch.Tensor, before=(), lr: float | None = None):
        """The step function: forward and backward of each micro-batch (`tensors` = x0, y, x0, y, ...),
        then the update. No host sync and no host-side state change, so that with one micro-batch and
        no `before` hooks a CUDA graph can capture it (graphs.py). Returns (loss, grad norm, the first
        micro-batch's labels after dropout)."""
        accum = len(tensors) // 2
        total = torch.zeros((), device=self.device)
        first = None
        for m in range(accum):
            x0, labels = tensors[2 * m], self._labels(tensors[2 * m + 1])
            first = labels if m == 0 else first
            with self.precision.context(cache=False):  # no autocast weight cache: a graph replays the casts
                loss, _ = self.objective(self.model, x0, labels, self.gen)
            scaled = loss / accum
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += loss.detach() / accum
        if self.scaler:
            self.scaler.unscale_(self.opt)  # true gradients before clipping (fp16)
        clip = self.cfg.optim.grad_clip
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else math.inf)
        if hasattr(gnorm, "full_tensor"):
            gnorm = gnorm.full_tensor()  # a DTensor under FSDP
        finite = torch.isfinite(total) & torch.isfinite(gnorm)
        if before:  # the look-ahead brackets the optimizer step, not a micro-step
            ctx = LookAheadContext(self.model, self.objective, tensors[0], first, self.step, self.dist.rank,
                                   self.dist.world_size, lr=lr, optimizer=self.opt)
            for h in before:
                with self.precision.context():
                    h.before_update(ctx)
        if self.scaler:  # fp16: the scaler skips an overflowing step itself (found_inf) and adapts its scale
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            skip_if_not_finite(self.opt, finite)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.ema.update(self.model, applied=finite)
        self.state.skipped += (~finite).long()
        self.state.skipped_run.copy_((self.state.skipped_run + 1) * (~finite).long())
        return total, gnorm.detach(), first

    # -- the run ---------------------------------------------------------------------------------------
    def fit(self) -> dict:
        tc, main, st = self.cfg.train, self.dist.is_main, self.state
        log = MetricLogger(self.run_dir, purge_step=self.step) if main else _NoLog()
        if main:
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))  # the truth, resumed or not
        if self.step == 0:
            log.log(0, params=self.num_params, images=0, world_size=self.dist.world_size)
        one = torch.ones((), device=self.device)
        self._skip_marks = [(self.step, int(self.state.skipped))]  # where the non-finite rate is counted from
        timed, t0 = 0, time.time()  # steps timed in this process (a resumed interval's earlier steps were not)
        bar = tqdm(total=tc.steps, initial=self.step, desc="train", unit="step", disable=not (tc.progress and main),
                   dynamic_ncols=True)
        try:
            with GracefulStop(self.dist.world_size) as stop:
                while self.step < tc.steps:
                    loss, gnorm = self.train_step()
                    ok = torch.isfinite(loss) & torch.isfinite(gnorm)
                    st.interval += torch.stack([loss.double(), gnorm.double(), one.double()]).where(ok, 0.0)
                    st.interval_steps += 1
                    timed += 1
                    bar.update(1)
                    if self.step % tc.log_every == 0 or self.step == tc.steps:
                        self._log(log, bar, timed, time.time() - t0)
                        timed, t0 = 0, time.time()
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

    def _log(self, log, bar, timed: int, dt: float) -> None:
        # the one host sync per log interval (and one all-reduce across ranks); loss and grad norm are
        # means over the interval's steps that were not skipped (None when all were)
        st = self.state
        loss_sum, gn_sum, n_ok = dist_utils.mean_across_ranks(st.interval).tolist()
        st.interval.zero_()
        st.interval_steps = 0
        mean_loss = loss_sum / n_ok if n_ok else None
        stats = self.objective.stats
        buckets = stats.bucketed(10, "raw") if stats is not None else None
        img_s = timed * self.images_per_step / dt if dt > 0 else None
        extra = self.objective.metrics()
        if self.interference is not None:
            extra.update(self.interference.metrics())
        hook_s = sum(v for k, v in extra.items() if k.endswith("lookahead_s"))
        cv = None if stats is None else float(loss_cv(stats, self.cfg.diagnostics.loss_cv_buckets))
        log.log(self.step, images=self.images, loss=mean_loss, grad_norm=gn_sum / n_ok if n_ok else None,
                lr=self.lr_sched.get_last_lr()[0], sec_per_step=dt / timed if timed else None, images_per_sec=img_s,
                mfu=img_s * self.flops_per_image / self.peak_flops if self.peak_flops and img_s else None,
                skipped_steps=int(st.skipped), loss_by_t_bucket=None if buckets is None else buckets["mean"],
                loss_cv=cv, lookahead_share=hook_s / dt if self.hooks and dt > 0 else None, **extra)
        bar.set_postfix(loss=f"{mean_loss:.4f}" if mean_loss is not None else "skipped")

    def _check_nonfinite(self) -> None:
        """Stop on a run of `max_nonfinite` skipped steps, or when at least `max_nonfinite_frac` of the
        last max(100, max_nonfinite) steps were skipped (scattered bad batches never make a run)."""
        tc, st = self.cfg.train, self.state
        total, run = torch.stack([st.skipped, st.skipped_run]).tolist()  # one host read
        marks = self._skip_marks
        marks.append((self.step, total))
        window = max(100, tc.max_nonfinite)
        while len(marks) > 1 and marks[1][0] <= self.step - window:
            marks.pop(0)
        step0, total0 = marks[0]
        frac = (total - total0) / max(self.step - step0, 1)
        if run >= tc.max_nonfinite:
            why = f"{run} non-finite steps in a row"
        elif self.step - step0 >= window and frac >= tc.max_nonfinite_frac:
            why = f"{total - total0} of the last {self.step - step0} steps were not finite"
        else:
            return
        kept = "the last good checkpoint is kept" if self.checkpoints.latest() else "no checkpoint had been written"
        crash = ", crash.pt holds this state" if self.dist.world_size == 1 else ""  # fit's handler writes it
        raise NonFiniteStop(f"stopped at step {self.step}: {why} (skipped, weights kept); {kept}{crash} "
                            f"(try a lower optim.lr, or check the data: `fasttrain data prepare`)")

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
        bad = int(self.state.skipped_run) > 0 or not self._weights_work()
        if bad:
            if self.dist.is_main:
                kept = "the previous last.pt is kept" if self.checkpoints.latest() else "no checkpoint is written"
                print(f"fasttrain: not saving at step {self.step}: the last steps were not finite ({kept})",
                      file=sys.stderr)
            return
        self.save()

    # -- the end of a run: samples, evaluation, plots -------------------------------------------------
    def eval_reference(self):
        """The real data evaluations compare with: read (and for folders decoded) once per run."""
        if self._eval_reference is None:
            self._eval_reference = reference_for(self.cfg, self.spec)
        return self._eval_reference

    def evaluate(self, log) -> dict:
        metrics = run_evaluation(self.bundle, EvalSettings.from_config(self.cfg),
                                 self.eval_reference())  # on every rank (FSDP forwards are collective)
        log.log(self.step, images=self.images, **{f"eval/{k}": v for k, v in metrics.items()})
        return metrics

    def finish(self, log) -> dict:
        cfg, out = self.cfg, {"steps": self.step, "images": self.images, "skipped_steps": int(self.state.skipped)}
        self.bundle.step, self.bundle.images = self.step, self.images
        if cfg.sample.num:
            labels = None
            if self.spec.num_classes and self.spec.image_size:
                labels = torch.arange(cfg.sample.num, device=self.device) % self.spec.num_classes
            n = cfg.sample.num if self.spec.image_size else max(cfg.sample.num, 2000)
            x = self.bundle.generate(n, labels, steps=cfg.sample.steps, solver=cfg.sample.solver,
                                     guidance=cfg.sample.guidance, eta=cfg.sample.eta, progress=cfg.train.progress)
            if self.dist.is_main:
                ref = self.eval_reference().train if not self.spec.image_size else None
                plots.save_samples(self.run_dir / "samples.png", x, self.spec, reference=ref)
                if self.spec.decodes:  # latents: also as the images the run's VAE decodes them into
                    _report_failure("no decoded samples", lambda: self.bundle.save_decoded(
                        self.run_dir / "samples-decoded.png", x))
                if not self.spec.image_size:
                    out["sample_mean"], out["sample_std"] = x.mean(0).tolist(), x.std(0).tolist()
        if cfg.eval.num_samples or cfg.eval.bpd:
            out["eval"] = self.evaluate(log)
        if self.dist.is_main and cfg.train.plots:
            plots.plot_run(self.run_dir, self.objective, title=f"{cfg.diffusion.prediction} · {cfg.diffusion.weighting}"
                           f" · {cfg.diffusion.sampler}", interference=self.interference)
        if self.dist.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(out, indent=2))
        return out

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()


class _NoLog:
    """What ranks other than 0 log to."""

    def log(self, *args, **kwargs):
        pass

    def close(self):
        pass


def train(cfg: DictConfig, resume: bool = False, restart: bool = False) -> dict:
    trainer = Trainer(cfg, resume=resume, restart=restart)
    try:
        if resume:
            last = trainer.checkpoints.latest()
            if last is None:
                raise ckpt.no_checkpoint(trainer.run_dir)
            trainer.restore(last)
        return trainer.fit()
    finally:
        trainer.close()


def _report_failure(what: str, fn) -> None:
    """Run `fn` while another error is propagating: a failure of its own is one line on stderr, so that
    it does not replace the error the user needs to see."""
    try:
        fn()
    except Exception as e:
        print(f"fasttrain: {what} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr)
