"""The trainer: a model bundle (bundle.py) plus data, optimizer, the step's parts and the run loop.

Reads top to bottom: set-up (the kernel backend, process group, data, network, parallelism, objective,
optimizer, the step's named parts, the periodic actions), checkpoint state out and in, one optimizer
step (step.py's function over the parts), the run loop, the end of the run. Progress is counted in
images as well as steps (EDM2). The step never syncs with the host: losses, gradient norms and
skipped-step counters stay on the device; what reads them back (the log line, the non-finite stop),
saves or evaluates is a periodic action with its own period (periodic/), run in its declared order.
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import conditioning, periodic, plots, seeds
from .bundle import DataSpec, ModelBundle, build_network, build_objective
from .config import plain
from .data import build_data
from .diffusion.align import Alignment
from .diffusion.interference import InterferenceDiagnostic
from .diffusion.objective import kernel_backend
from .errors import DeviceError, InvalidInput
from .generation.evaluate import EvalSettings, RunEvaluation
from .generation.prompts import RunPrompts
from .logger import MetricLogger
from .models import MODELS, count_params, forward_flops, weights_from_checkpoint
from .optim.adamw import apply_optimizer_config, make_optimizer
from .optim.phema import PowerEMA
from .parallel import distributed as dist_utils
from .parallel import graphs
from .parallel.cpu import evaluation_threads, set_threads
from .parallel.precision import resolve as resolve_precision
from .parallel.wrap import parallelize
from .periodic.evaluation import log_metrics
from .pretrained import lora, text_lora
from .step import Generators, StepParts, update
from .step import train_step as run_step
from .stopping import GracefulStop
from .train_state import RankRNG, StepClock, TrainState


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
        # the kernel backend, decided once for this device: an impossible one is a line before any file is written
        self.kernels = kernel_backend(cfg.diffusion.backend, self.device, key="diffusion.backend")
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
        # the data section whole: the data kind reads its own fields (data/kinds.py)
        self.data, info = build_data(d, seed=tc.seed, device=self.device, rank=rank, world_size=world,
                                     batches_per_step=tc.grad_accum)
        conditional = cfg.model.class_conditional and info.num_classes > 0
        self.spec = DataSpec(d.name, info.channels, info.image_size, info.num_classes if conditional else 0,
                             cfg.model.label_dropout, info.latents, info.class_names if conditional else None,
                             info.text)
        with torch.random.fork_rng(devices=[]):  # the same initial weights on every rank
            torch.manual_seed(seeds.derive(tc.seed, "weights"))
            net = build_network(cfg, self.spec).to(self.device)
        lora.hold_base(net, lora.base_dtype(cfg, self.device))  # a LoRA run's frozen base: bf16 on CUDA (lora.py)
        self.alignment = None  # REPA (diffusion/align.py): hooks on the network before it is parallelised
        if cfg.diffusion.align.encoder is not None:
            self.alignment = Alignment(cfg.diffusion.align, net, self.device)
            self.data = self.alignment.cache(self.data)  # resident data: its targets once per image
        table = None
        if info.text_table is not None:  # captioned data: the network gathers their cached encodings
            table = info.text_table
            if text_lora.enabled(cfg):  # or their token ids, for its adapted encoders (pretrained/text_lora.py)
                table = text_lora.run_table(net, table, info.captions, d.root or d.name)
            table = table.to(self.device)
            conditioning.attach(net, table)
        self.num_params = count_params(net)
        pc = cfg.parallel
        strategy = pc.strategy if pc.strategy != "auto" else ("fsdp" if world > 1 else "none")
        if strategy == "none" and world > 1:
            raise InvalidInput(f"parallel.strategy=none cannot train on {world} processes (use fsdp or ddp)")
        self.precision = resolve_precision(pc.precision, self.device, strategy)
        self.model = parallelize(net, strategy, pc.ac, pc.compile, self.precision.name, self.device, pc.compile_mode,
                                 pc.channels_last)
        self.objective = build_objective(cfg, net, rank, backend=self.kernels).to(self.device)
        self.objective.input_dtype = self.precision.input_dtype
        self.objective.set_partition(rank, world, tc.grad_accum)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision.scaler else None
        self.bundle = ModelBundle.build(cfg, self.spec, self.device, net=self.model)
        self.ema = self.bundle.ema
        images_per_step = d.batch_size * tc.grad_accum * world  # all ranks'
        # post-hoc EMA profiles (optim/phema.py), snapshots by the ema_snapshots action; None when phema.every=0
        self.phema = PowerEMA(self.model, cfg.phema.sigma_rels, images_per_step) if cfg.phema.every else None
        dg = cfg.diagnostics
        self.interference = None
        interference = dg.interference_every
        if interference and getattr(info.text_table, "per_batch", False):
            interference = 0  # its probe keeps a batch's caption codes for later steps: valid within their step only
            if self.dist.is_main:
                print(f"fasttrain: note: the interference diagnostic is off (diagnostics.interference_every="
                      f"{dg.interference_every}): data.name={d.name} holds only the current step's caption encodings "
                      f"on the device, and its probe keeps a batch for later steps", file=sys.stderr)
        if interference:
            self.interference = InterferenceDiagnostic(self.objective.T, dg.interference_every, dg.buckets,
                                                       dg.probe_size, seeds.derive(tc.seed, "probe"))
        self.hooks = self.objective.lookaheads() + ([self.interference] if self.interference else [])
        # a LoRA run (lora.py): the adapter alone; otherwise every parameter
        # text-encoder LoRA: its adapter in a group of its own, at optim.text_encoder_lr (text_lora.py)
        self.opt = make_optimizer(text_lora.parameter_groups(self.model, cfg.optim), cfg.optim, self.device)
        o = cfg.optim
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
        # per rank, so that stratified strata are filled independently; label dropout has its own stream
        generators = Generators(torch.Generator(self.device).manual_seed(seeds.derive(tc.seed, "timesteps", rank)),
                                torch.Generator(self.device).manual_seed(seeds.derive(tc.seed, "labels", rank)))
        self.state = TrainState(self.device)
        lora.seed_dropout(cfg, seeds.derive(tc.seed, "lora_dropout", rank))  # a LoRA run's dropout, per rank
        cond = conditioning.for_data(self.spec, cfg.model.label_dropout, generators.labels, table, d.caption_dropout,
                                     d.keep_tokens if d.shuffle_caption else None)
        self.parts = StepParts(self.model, self.objective, self.opt, generators, ema=self.ema, scaler=self.scaler,
                               conditioning=cond, precision=self.precision, grad_clip=o.grad_clip, counters=self.state,
                               hooks=self.hooks, rank=rank, world_size=world,
                               masked=d.mask != "none" or info.loss_weights,  # data.prior's weights ride on the mask
                               averages=(self.phema,) if self.phema is not None else (), align=self.alignment)
        # evaluations of the bundle (periodic/evaluation.py, the end of the run): every core of a one-process CPU run
        self._threads = partial(evaluation_threads, tc.threads, self.device.type == "cpu" and world == 1)
        self.evaluation = RunEvaluation(self.bundle, EvalSettings.from_config(cfg), cfg, self._threads)
        self.actions = periodic.build(cfg)  # logging, checkpoints, evaluation, ... (periodic/): declared, in order
        self.checkpoints = ckpt.CheckpointManager(
            self.run_dir, self.dist, meta={"config": OmegaConf.to_container(cfg), "data_spec": asdict(self.spec),
                                 **({"lora": lora.identity(net)} if lora.identity(net) else {})},
            model=self.model, optimizer=self.opt, ema=self.ema,
            states={"train": self.state, "lr_sched": self.lr_sched, "objective": self.objective, "data": self.data,
                    "interference": self.interference, "scaler": self.scaler},
            rank_states={"rng": RankRNG(generators, tc.seed, self.state), "objective": self.objective},
            averages={"phema": self.phema})
        # the step's body for one micro-batch: eager, or replayed from one CUDA graph (parallel/graphs.py decides)
        self.step_fn = graphs.step_function(partial(update, self.parts), self.parts, tc.cuda_graph,
                                            device=self.device, grad_accum=tc.grad_accum, announce=self.dist.is_main,
                                            fixed_shape=info.fixed_shape)
        peak = dist_utils.device_peak_flops()
        text = {"text": self.spec.text} if self.spec.text is not None else {}  # the text network's shapes
        flow = MODELS.get(cfg.model.name).flow
        if flow is not None and flow(plain(cfg.model.args)):  # SD3: its time input is the flow σ table
            text["flow_sigma"] = self.bundle.schedule.sigma.cpu()
        flops_per_image = 3 * forward_flops(cfg.model.name, in_channels=self.spec.channels,
                                            image_size=self.spec.image_size, num_classes=self.spec.num_classes,
                                            **plain(cfg.model.args), **text) if peak else None
        self.throughput = periodic.Throughput(images_per_step, flops_per_image,
                                              peak * world if peak else None)
        # what the periodic actions read, by name (periodic.RunParts; log, bar and clock: when the loop starts)
        self.run_parts = periodic.RunParts(
            state=self.state, model=self.model, ema=self.ema, objective=self.objective, spec=self.spec,
            device=self.device, dist=self.dist, run_dir=self.run_dir, checkpoints=self.checkpoints,
            lr_sched=self.lr_sched, hooks=self.hooks, interference=self.interference, evaluate=self.evaluation,
            throughput=self.throughput, phema=self.phema, alignment=self.alignment)
        self.views = {a: periodic.view(self.run_parts, a) for a in self.actions}  # each its declared parts

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def images(self) -> int:
        return self.state.images

    # the run loop's parts the actions read, made when the loop starts (fit; a benchmark may set its own)
    log = property(lambda self: self.run_parts.log, lambda self, v: setattr(self.run_parts, "log", v))
    bar = property(lambda self: self.run_parts.bar, lambda self, v: setattr(self.run_parts, "bar", v))
    clock = property(lambda self: self.run_parts.clock, lambda self, v: setattr(self.run_parts, "clock", v))

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
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: the step function (step.py; its body replayed from a CUDA graph where it
        can be) on the step's micro-batches, then the LR scheduler and the counters."""
        batches = [next(self.data) for _ in range(self.cfg.train.grad_accum)]
        loss, gnorm = run_step(self.parts, batches, step=self.step, lr=self.lr_sched.get_last_lr()[0],
                               fixed=self.step_fn)
        self.lr_sched.step()
        self.state.step += 1
        self.state.images += self.throughput.images_per_step
        self._act(in_step=True)  # the step's bookkeeping actions: the statistics sync
        return loss, gnorm

    # -- the run ---------------------------------------------------------------------------------------
    def fit(self) -> dict:
        tc, main = self.cfg.train, self.dist.is_main
        self.log = MetricLogger(self.run_dir, purge_step=self.step) if main else _NoLog()
        if main:
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))  # the truth, resumed or not
        if self.step == 0:
            self.log.log(0, params=self.num_params, images=0, world_size=self.dist.world_size)
        one = torch.ones((), device=self.device)
        for action in self.actions:  # before the clock starts: an evaluation at step 0 is not training time
            action.start(self.views[action])
        self.clock = StepClock()  # steps timed in this process (a resumed interval's earlier steps were not)
        self.bar = tqdm(total=tc.steps, initial=self.step, desc="train", unit="step",
                        disable=not (tc.progress and main), dynamic_ncols=True)
        try:
            with GracefulStop(self.dist.world_size) as stop:
                while self.step < tc.steps:
                    self.advance(one)
                    if stop.should_stop():
                        self._act_final()
                        raise KeyboardInterrupt
        except BaseException as e:
            self.bar.close()
            # Nothing lost: a signal saves a resumable last.pt (above, at a step boundary); an error
            # saves crash.pt for inspection and keeps the last good last.pt. (Across ranks a collective
            # save could hang on a rank that died, so there the last periodic checkpoint is what resumes.)
            if not isinstance(e, KeyboardInterrupt) and self.dist.world_size == 1:
                _report_failure("crash.pt not written", lambda: self.save("crash.pt"))
            _report_failure("the log was not closed cleanly", self.log.close)  # the original error is the one raised
            raise
        self.bar.close()
        self._act_final()  # the last checkpoint, before the final sync, so that a resumed run continues exactly
        self.objective.sync_stats()
        summary = self.finish(self.log)
        self.log.close()
        return summary

    def advance(self, one: torch.Tensor) -> None:
        """One step of the run as `fit` takes it (bench/profile_default.py times this same body): the step,
        the log interval's sums on the device (a non-finite step adds nothing), the clock, the progress bar,
        and the periodic actions that are due (logging, the non-finite stop, checkpoints, evaluation, ...)."""
        loss, gnorm = self.train_step()
        ok = torch.isfinite(loss) & torch.isfinite(gnorm)
        st = self.state
        st.interval += torch.stack([loss.double(), gnorm.double(), one.double()]).where(ok, 0.0)
        st.interval_steps += 1
        self.clock.tick()
        self.bar.update(1)
        self._act(in_step=False)

    def _act(self, in_step: bool) -> None:
        """The periodic actions (periodic/) due after this step, in their declared order: those of the
        step's bookkeeping (`in_step`, from train_step) or those of the run loop; actions that pause the
        clock do not count as training time."""
        last = self.step == self.cfg.train.steps
        for action in self.actions:
            if action.in_step == in_step and action.due(self.step, last):
                with self.clock.paused() if action.pauses_clock and self.clock else contextlib.nullcontext():
                    action(self.views[action])

    def _act_final(self) -> None:
        """The actions that also act when the run stops or ends (`final`: the checkpoint)."""
        for action in self.actions:
            if action.final:
                action(self.views[action])

    # -- the end of a run: samples, evaluation, plots -------------------------------------------------
    def eval_reference(self):
        """The real data evaluations compare with: read (and for folders decoded) once per run."""
        return self.evaluation.reference()

    def eval_threads(self):
        """Evaluation and the end's samples on every core of a one-process CPU run (cpu.evaluation_threads;
        under torchrun the ranks share the cores)."""
        return self._threads()

    def evaluate(self, log) -> dict:
        """Evaluate the bundle (on every rank: FSDP forwards are collective) and log its metrics as eval/*."""
        return log_metrics(log, self.step, self.images, self.evaluation())

    def finish(self, log) -> dict:
        cfg, out = self.cfg, {"steps": self.step, "images": self.images, "skipped_steps": int(self.state.skipped)}
        self.bundle.step, self.bundle.images = self.step, self.images
        if cfg.sample.num:
            labels = None
            if self.spec.num_classes and self.spec.image_size:
                labels = torch.arange(cfg.sample.num, device=self.device) % self.spec.num_classes
            n = cfg.sample.num if self.spec.image_size else max(cfg.sample.num, 2000)
            text = RunPrompts.sample_args(cfg.sample) if self.spec.text is not None else {}
            with self.eval_threads():
                x = self.bundle.generate(n, labels, steps=cfg.sample.steps, solver=cfg.sample.solver,
                                         guidance=cfg.sample.guidance, eta=cfg.sample.eta,
                                         progress=cfg.train.progress, **text)
            if self.dist.is_main:
                ref = self.eval_reference().train if not self.spec.image_size else None
                nrow = None
                if self.spec.text is not None:  # one column per prompt; the report lists them (report.py)
                    prompts = text["prompts"] or self.spec.text["prompts"]
                    nrow = min(len(prompts), n)
                    (self.run_dir / "sample-prompts.json").write_text(json.dumps({"columns": prompts[:nrow]}))
                plots.save_samples(self.run_dir / "samples.png", x, self.spec, reference=ref, nrow=nrow)
                if self.spec.decodes:  # latents: also as the images the run's VAE decodes them into
                    def decoded():
                        images = self.bundle.decode(x)
                        plots.save_samples(self.run_dir / "samples-decoded.png", images, self.spec.decoded(images))

                    _report_failure("no decoded samples", decoded)
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
