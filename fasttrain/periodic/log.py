"""The log line every `train.log_every` steps (and at the last step): the one host read of the log
interval's loss and gradient-norm sums (one all-reduce across ranks; means over the interval's steps
that were not skipped, None when all were), the bucketed statistics, throughput and MFU, the sampler's
and the diagnostics' metrics; to metrics.jsonl and TensorBoard (logger.py) and the progress bar."""
from __future__ import annotations

from ..diffusion.variation import loss_cv
from ..parallel import distributed as dist_utils
from . import Periodic, register


@register("log")
class Log(Periodic):
    order = 20
    reads = ("state", "objective", "interference", "hooks", "lr_sched", "log", "bar", "clock", "throughput", "step",
             "images")
    saves = ("metrics.jsonl", "tb/")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.every, self.buckets = cfg.train.log_every, cfg.diagnostics.loss_cv_buckets

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0 or last

    def __call__(self, run) -> None:
        st, clock = run.state, run.clock
        timed, dt = clock.read()
        loss_sum, gn_sum, n_ok = dist_utils.mean_across_ranks(st.interval).tolist()
        st.interval.zero_()
        st.interval_steps = 0
        mean_loss = loss_sum / n_ok if n_ok else None
        stats = run.objective.stats
        buckets = stats.bucketed(10, "raw") if stats is not None else None
        rate = run.throughput
        img_s = timed * rate.images_per_step / dt if dt > 0 else None
        extra = run.objective.metrics()
        if run.interference is not None:
            extra.update(run.interference.metrics())
        hook_s = sum(v for k, v in extra.items() if k.endswith("lookahead_s"))
        cv = None if stats is None else float(loss_cv(stats, self.buckets))
        peak, flops = rate.peak_flops, rate.flops_per_image
        run.log.log(run.step, images=run.images, loss=mean_loss, grad_norm=gn_sum / n_ok if n_ok else None,
                    lr=run.lr_sched.get_last_lr()[0], sec_per_step=dt / timed if timed else None,
                    images_per_sec=img_s, mfu=img_s * flops / peak if peak and img_s else None,
                    skipped_steps=int(st.skipped), loss_by_t_bucket=None if buckets is None else buckets["mean"],
                    loss_cv=cv, lookahead_share=hook_s / dt if run.hooks and dt > 0 else None, **extra)
        run.bar.set_postfix(loss=f"{mean_loss:.4f}" if mean_loss is not None else "skipped")
        clock.reset()
