"""Adaptive non-uniform timestep sampling (Kim, Ki, Shim, Lee; arXiv 2411.09998, CVPR 2025): a policy
π_φ(t | x0) learns, by REINFORCE, to favour the timesteps whose updates lower the variational bound.

    smp = fd.timestep_sampler("adaptive", schedule)                          # fasttrain's defaults
    smp = fd.timestep_sampler("adaptive", schedule, tau_grid=0, every=40)    # the official setting

fasttrain's defaults differ from the official setting in two places, both for cost: `tau_grid` = 16
strata instead of all 1000 timesteps, and `every` = 100 steps between look-ahead updates instead of 40.
Each look-ahead costs two no-grad forwards of K + 3·B probe elements (the τ-grid and the batch at S),
about 1.5-3 training steps on the CPU tiny models, so at every = 40 it alone is 5-7% of the step time
there, and the per-step policy draw adds 1-4% (bench/results/adaptive-overhead-cpu.md); a 5% budget
needs the longer period. n_select, capacity, lr, entropy and the clip stay official.

The official algorithm (ku-dmlab/Adaptive-Timestep-Sampler, ddpm_torch/utils/train.py:268-358), every
f_S = 40 optimizer steps (`every`), around the model update θ_k → θ_{k+1}:
  1. before: single-step VLB terms (vlb.py) L_τ(x0*; θ_k) on the τ-grid for one x0* of the batch,
     and L_s(x0_b; θ_k) for every sample b at the selected set S (|S| = n_select = 3, S₀ = {0, 1, 2});
  2. after: the same with θ_{k+1}; δ_τ = L_τ(θ_k) − L_τ(θ_{k+1}); (δ, Σ_τ δ_τ) into a FIFO of
     `capacity` = 20 rows; once it holds 2 rows, S ← the n_select τ with the highest univariate
     F-statistic of δ_τ against Σ_τ δ_τ (sklearn SelectKBest(f_regression); `f_statistic` here);
  3. policy: r_b = Σ_{s∈S} (L_s(x0_b; θ_k) − L_s(x0_b; θ_{k+1})) + c·H(π(·|x0_b)) with S from
     before the re-selection and c = `entropy` = 1e-2 (the entropy is not detached, as official);
     loss −mean_b log π(u_b | x0_b)·r_b, gradient clipped at 1.0, Adam(lr = 1e-2, betas 0.9, 0.999).
The policy is a Beta over u with t = round(u·(T−1)) (policy.py); the sampled t are used as they are
(biased: the objective changes on purpose) unless `unbiased`, which returns iw = 1/(T·p(t | x0)).

What is done differently, and why:
  * one model forward per bound evaluation (the official `compute_singlestep_KL` runs two);
  * common random numbers: the probe's x_τ is drawn once (lookahead.Probe) and reused after the
    update, so δ measures the update and not fresh noise (the official draws new noise each time);
  * `tau_grid` = K > 0 evaluates a stratified subset of the τ-grid (one τ per stratum
    [⌊kT/K⌋, ⌊(k+1)T/K⌋), resampled every update; the FIFO's columns and S are strata);
    K = 0 is all T timesteps (official);
  * no host sync: the F-statistic and the selection run on the device (a stable sort that breaks
    ties as SelectKBest does), counters that decide control flow are host integers;
  * any resolution, channel count and world size: ranks split the τ-grid (lookahead.RankSplit),
    x0* is broadcast from rank 0, and the grid's δ, the policy gradient and the reward statistics
    travel in ONE all-reduce; the policy starts from a fixed seed and steps on the all-reduced
    gradient, so it is identical on every rank;
  * the look-ahead brackets the optimizer step (the trainer's hook, lookahead.py), and the policy
    learns from the draws of the step's first micro-batch (`set_partition` tells it the accumulation).
"""
from __future__ import annotations

import copy

import torch

from fasttrain import seeds
from fasttrain.kernels import philox

from ..errors import InvalidInput
from . import policy as pol
from .lookahead import HookTimer, LookAhead, LookAheadContext, Probe, RankSplit, all_reduce_sum_, broadcast_, x0_mse
from .samplers import TimestepSampler, register
from .schedule import NoiseSchedule
from .vlb import VARIANCES, valid_steps, vlb_tables

POLICIES = ("beta", "global")
STRIDE = 1 << 40            # noise counters per look-ahead: update k uses [k·STRIDE, (k+1)·STRIDE)
AB_KEEP = 32                # (α, β) pairs kept per snapshot for probs() and the p(t) history
HISTORY_MAX = 2048          # history entries kept; beyond, every other old entry is dropped


def f_statistic(X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Univariate F-statistic of each column of X [n, p] against y [n]: scikit-learn's
    `f_regression(X, y)` (center=True, force_finite=True): r = corr(X_j, y),
    F = r²/(1 − r²)·(n − 2); a constant column (r undefined) gets 0, a perfect fit the largest float.
    float64, on X's device, no host sync."""
    X, y = X.double(), y.double().reshape(-1)
    Xc, yc = X - X.mean(0), y - y.mean()
    r = (yc @ Xc) / (torch.linalg.vector_norm(Xc, dim=0) * torch.linalg.vector_norm(yc))
    F = r**2 / (1 - r**2) * (X.shape[0] - 2)
    F = torch.where(torch.isnan(F), torch.zeros_like(F), F)
    return torch.where(torch.isinf(F), torch.full_like(F, torch.finfo(F.dtype).max), F)


def select_k_best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores, ascending: SelectKBest's `argsort(kind="mergesort")[-k:]`, so
    that ties go to the later index exactly as in the official code (a stable sort on the device)."""
    return torch.sort(torch.sort(scores, stable=True).indices[-k:]).values


def _subseed(seed: int, stream: int) -> int:
    """A Philox key per (sampler seed, stream): grid draws, x0* choice, probe noise of each rank."""
    return seeds.derive(seed, "probe", stream)


@register("adaptive")
class Adaptive(TimestepSampler, LookAhead):
    """policy: beta (conditioned on x0) | global (two parameters); unbiased: iw = 1/(T·p(t|x0));
    tau_grid: strata evaluated per look-ahead (0 = all T, official); every: steps between look-aheads
    (official 40); n_select, capacity, lr, entropy, grad_clip: official; variance: the bound's fixed
    model variance (large, official | small);
    width: channels of the policy's first conv; chunk: probe elements per forward (0 = 4 micro-batches);
    seed: the policy's initialisation and the probes' noise (the same on every rank)."""
    seeded = True

    def __init__(self, schedule: NoiseSchedule, policy: str = "beta", unbiased: bool = False, tau_grid: int = 16,
                 every: int = 100, n_select: int = 3, capacity: int = 20, lr: float = 1e-2, entropy: float = 1e-2,
                 grad_clip: float = 1.0, variance: str = "large", width: int = 16, chunk: int = 0, seed: int = 0):
        super().__init__(schedule)
        if policy not in POLICIES:
            raise InvalidInput(f"unknown adaptive policy {policy!r}; choose from {', '.join(POLICIES)}")
        if variance not in VARIANCES:
            raise InvalidInput(f"variance must be one of {', '.join(VARIANCES)}, got {variance!r}")
        if not 0 <= tau_grid <= self.T:
            raise InvalidInput(f"tau_grid must lie in [0, T={self.T}] (0 = all timesteps), got {tau_grid!r}")
        self.K = self.T if tau_grid == 0 else int(tau_grid)
        for name, v, lo in (("every", every, 1), ("capacity", capacity, 2), ("n_select", n_select, 1),
                            ("width", width, 1), ("chunk", chunk, 0)):
            if v < lo:
                raise InvalidInput(f"{name} must be >= {lo}, got {v!r}")
        if n_select > self.K:
            raise InvalidInput(f"n_select={n_select} exceeds the τ-grid's {self.K} strata (tau_grid)")
        if not (lr > 0 and entropy >= 0 and grad_clip > 0):
            raise InvalidInput("lr and grad_clip must be > 0 and entropy >= 0")
        self.policy_kind, self.unbiased, self.biased = policy, bool(unbiased), not unbiased
        self.every, self.n_select, self.capacity = int(every), int(n_select), int(capacity)
        self.lr, self.entropy, self.grad_clip = float(lr), float(entropy), float(grad_clip)
        self.variance, self.width, self.chunk, self.seed = variance, int(width), int(chunk), philox.check_seed(seed)
        self.schedule = schedule
        # strata of the τ-grid: [lo_k, lo_k + width_k); K = T gives one timestep each
        edges = torch.div(torch.arange(self.K + 1) * self.T, self.K, rounding_mode="floor")
        self.strata_lo, self.strata_w = edges[:-1].to(self.device), (edges[1:] - edges[:-1]).to(self.device)
        self.fifo_X = torch.zeros(self.capacity, self.K, dtype=torch.float64, device=self.device)
        self.fifo_y = torch.zeros(self.capacity, dtype=torch.float64, device=self.device)
        self.fifo_count = 0                      # host counters: they decide control flow, never read back
        self.updates = 0
        self.S = torch.arange(self.n_select, device=self.device)  # official initial S = {0, 1, 2}
        self.rank, self.world_size, self.accum_steps, self.micro_step = 0, 1, 1, 0
        self.net: torch.nn.Module | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.in_shape: tuple[int, ...] | None = None
        self._u = None                           # u of the step's first micro-batch
        self._conc = None                        # its (α, β) [B, 2], for probs()
        self._pending = None                     # (probe, split, before-values) between the hooks
        self._tables: dict = {}
        self._metrics: dict = {}
        self.timer = HookTimer()
        self.hist_steps: list[int] = []
        self.hist_ab: list[torch.Tensor] = []    # [≤AB_KEEP, 2] per update
        self.hist_S: list[torch.Tensor] = []     # [n_select] timesteps at which the reward was measured
        if policy == "global":
            self._build(None)

    # -- the policy ------------------------------------------------------------------------------
    def _build(self, in_shape):
        """Policy and optimizer from a fixed seed (not the rank): identical on every process."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            net = pol.GlobalBeta() if self.policy_kind == "global" else pol.ConditionalBeta(in_shape, self.width)
        self.in_shape = None if in_shape is None else tuple(int(s) for s in in_shape)
        self.net = net.to(self.device)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=self.lr, betas=(0.9, 0.999))

    def _conc_of(self, x0: torch.Tensor | None, n: int) -> torch.Tensor:
        """The policy's (α, β) per sample, [n, 2] fp32 (outside any autocast region)."""
        if self.policy_kind == "global":
            return self.net(None, n)
        if x0 is None:
            raise ValueError("the adaptive sampler with policy='beta' is conditioned on x0: pass sample(n, generator, "
                             "x0)")
        if self.net is None:
            self._build(x0.shape[1:])
        if torch.is_autocast_enabled(x0.device.type):
            with torch.autocast(x0.device.type, enabled=False):
                return self.net(x0)
        return self.net(x0)

    def set_partition(self, rank=0, world_size=1, accum_steps=1):
        self.rank, self.world_size, self.accum_steps = int(rank), int(world_size), int(accum_steps)

    def lookahead(self) -> Adaptive:
        return self  # the policy learns from the look-ahead around the optimizer step

    def sample(self, n, generator=None, x0=None):
        # Every op here runs once per micro-batch: on CPU each costs ~20-40 µs right after a training
        # step (cold caches), so the path is kept short (no clamps, stacks or copies it does not need).
        with torch.no_grad():
            conc = self._conc_of(x0, n)
            u = pol.sample(conc, generator)
        t = pol.to_timestep(u, self.T)
        if self.micro_step == 0:  # the draws the look-ahead's reward will be credited to
            self._u, self._conc = u, conc
        self.micro_step = (self.micro_step + 1) % self.accum_steps
        if not self.unbiased:
            return t, torch.ones(n, dtype=torch.float32, device=t.device)
        p = pol.timestep_masses(conc[:, 0], conc[:, 1], t, self.T)  # p(t_b | x0_b) of the exact Beta
        return t, (1.0 / (self.T * p.clamp_min(1e-12))).float()

    def probs(self, n=None) -> torch.Tensor:
        """p(t), float64 [T]: exact for policy='global' (its current parameters); for policy='beta' the
        marginal over the first AB_KEEP samples of the latest step's first micro-batch, under the
        policy that drew them."""
        if self.policy_kind == "global":
            with torch.no_grad():
                ab = self.net(None, 1)
        elif self._conc is not None:
            ab = self._conc[:AB_KEEP]
        else:  # before the first draw: the initial policy (weights 0, bias 0.5 in the last layer)
            init = torch.nn.functional.softplus(torch.tensor(pol.INIT_BIAS)) + pol.MIN_CONC
            ab = init.expand(1, 2).to(self.device)
        return pol.timestep_probs(ab[:, 0], ab[:, 1], self.T)

    # -- the look-ahead --------------------------------------------------------------------------
    def _grid(self, update: int) -> torch.Tensor:
        """This update's τ per stratum: lo_k + ⌊u_k·width_k⌋, u_k from Philox (the same on every rank)."""
        words = philox.philox4x32(_subseed(self.seed, 1),
                                  torch.arange(self.K, device=self.device) + update * self.K)
        u = philox.uniform(words[0]).double()
        return self.strata_lo + torch.minimum((u * self.strata_w).long(), self.strata_w - 1)

    def _chunk(self, B: int) -> int:
        """Probe elements per forward: `chunk`, or 4 micro-batches (a no-grad forward of 4B holds far
        less than the training forward of B with its saved activations; fewer, larger calls are
        faster on CPU and GPU alike)."""
        return self.chunk or 4 * B

    def _vlb(self, mse, t, model):
        key = (mse.device, id(model))
        if key not in self._tables:
            sch = self.schedule.to(mse.device)
            coef, const = vlb_tables(sch, self.variance)
            self._tables = {key: (coef.float(), const.float(), valid_steps(sch, model.x0_defined().to(mse.device)))}
        coef, const, valid = self._tables[key]
        return torch.where(valid[t], coef[t] * mse + const[t], torch.zeros_like(mse))

    def before_update(self, ctx: LookAheadContext) -> None:
        x0, B, n = ctx.x0, ctx.x0.shape[0], self.n_select
        if self._u is None or self._u.shape[0] != B:
            raise RuntimeError("adaptive sampler: before_update needs this step's draws for ctx.x0 (sample() on the "
                               "step's first micro-batch; call set_partition(rank, world, accum_steps) once)")
        with self.timer.span(x0.device):
            W = ctx.world_size
            grid = self._grid(self.updates)
            split = RankSplit(self.K, ctx.rank, W, x0.device)
            # x0*: one sample of rank 0's batch, shared by every rank (official: the leader's `x_sampled`)
            u_star = philox.uniform(philox.philox4x32(_subseed(self.seed, 2),
                                                      torch.full((1,), self.updates, device=x0.device))[0])
            j = torch.clamp((u_star.double() * B).long(), max=B - 1)
            star = x0.index_select(0, j).flatten().float()
            lab = None if ctx.labels is None else ctx.labels.index_select(0, j)
            if lab is not None:
                star = torch.cat([star, lab.float()])  # labels < 2^24 travel exactly as floats
            broadcast_(star, W)
            lab_star = None if lab is None else star[-1:].long()
            star = star[:x0[0].numel()].view(1, *x0.shape[1:]).to(x0.dtype)
            D = star.numel()
            shape = (split.per,) + tuple(x0.shape[1:])
            g_probe = Probe.draw(ctx.objective, star.expand(shape).contiguous(), grid[split.index],
                                 None if lab_star is None else lab_star.expand(split.per),
                                 seed=_subseed(self.seed, 3), offset=self.updates * STRIDE + split.start * D)
            s_tau = grid[self.S]
            b_probe = Probe.draw(ctx.objective, x0.repeat_interleave(n, 0), s_tau.repeat(B),
                                 None if ctx.labels is None else ctx.labels.repeat_interleave(n, 0),
                                 seed=_subseed(self.seed, 4 + ctx.rank), offset=self.updates * STRIDE)
            probe = Probe.cat(g_probe, b_probe)
            chunk = self._chunk(B)
            before = self._vlb(x0_mse(ctx.model, probe, chunk), probe.t, ctx.model)
            self._pending = (probe, split, before, s_tau)

    def after_update(self, ctx: LookAheadContext) -> None:
        if self._pending is None:
            raise RuntimeError("adaptive sampler: after_update without before_update")
        probe, split, before, s_tau = self._pending
        self._pending = None
        x0, B, n, W = ctx.x0, ctx.x0.shape[0], self.n_select, ctx.world_size
        with self.timer.span(x0.device):
            after = self._vlb(x0_mse(ctx.model, probe, self._chunk(B)), probe.t, ctx.model)
            delta = before - after
            d_grid = split.scatter(delta[:split.per])
            reward = delta[split.per:].view(B, n).sum(1)
            d_grid, st = self.policy_step(x0, reward, extra=d_grid, world_size=W)
            # FIFO of (δ, Σδ) and the re-selection of S (official L320-338)
            row = self.fifo_count % self.capacity
            self.fifo_X[row] = d_grid.double()
            self.fifo_y[row] = d_grid.double().sum()
            self.fifo_count += 1
            if self.fifo_count > 1:
                m = min(self.fifo_count, self.capacity)
                self.S = select_k_best(f_statistic(self.fifo_X[:m], self.fifo_y[:m]), n)
            ab = st.pop("ab")
            self._metrics = dict(st, **{"adaptive/updates": float(self.updates + 1)})
            for i in range(n):
                self._metrics[f"adaptive/S{i}"] = s_tau[i]
            self._record(ctx.step, ab, s_tau)
            self.updates += 1

    def policy_step(self, x0, reward: torch.Tensor, extra: torch.Tensor | None = None, world_size: int = 1):
        """One REINFORCE step of the policy (official train.py L340-350) on the draws recorded for the
        step's first micro-batch, with per-sample rewards `reward` [B] of this rank's samples:
        loss = −Σ_b log π(u_b|x0_b)·(r_b + c·H_b) / (B·world), H not detached (as official). The
        gradient, `extra` (the grid's δ) and the reward statistics are summed over ranks in ONE
        all-reduce; the step (clip, Adam) then runs on identical values everywhere. Returns the
        reduced `extra` and the metrics (0-d tensors, plus "ab": the (α, β) kept for the history).
        The look-ahead calls this; tests drive it with synthetic rewards (a bandit)."""
        B = reward.shape[0]
        params = list(self.net.parameters())
        with torch.enable_grad():
            a, b = self._conc_of(x0, B).unbind(-1)
            logp, H = pol.log_prob(pol.clamp_u(self._u), a, b), pol.entropy(a, b)
            r = reward.detach().float() + self.entropy * H
            loss = -(logp * r).sum() / (B * world_size)
            grads = torch.autograd.grad(loss, params)
        reward = reward.detach().float()
        stats = torch.stack([reward.sum(), H.detach().sum(), a.detach().sum(), b.detach().sum(), reward.pow(2).sum()])
        head = [] if extra is None else [extra.float()]
        packed = torch.cat(head + [g.reshape(-1).float() for g in grads] + [stats])
        all_reduce_sum_(packed, world_size)  # the one collective of the update
        at = 0 if extra is None else extra.numel()
        for p_, g in zip(params, grads):
            p_.grad = packed[at:at + g.numel()].view_as(p_).clone()
            at += g.numel()
        torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        n = B * world_size
        mean_r = packed[-5] / n
        out = {"adaptive/reward": mean_r, "adaptive/reward_std": (packed[-1] / n - mean_r**2).clamp_min(0).sqrt(),
               "adaptive/policy_entropy": packed[-4] / n, "adaptive/alpha": packed[-3] / n,
               "adaptive/beta": packed[-2] / n, "ab": torch.stack([a[:AB_KEEP], b[:AB_KEEP]], -1).detach()}
        return (None if extra is None else packed[:extra.numel()]), out

    # -- observability -----------------------------------------------------------------------------
    def _record(self, step: int, ab: torch.Tensor, s_tau: torch.Tensor) -> None:
        if len(self.hist_steps) >= HISTORY_MAX:  # thin the older half, keep the recent half at full rate
            half = HISTORY_MAX // 2
            keep = list(range(0, half, 2)) + list(range(half, len(self.hist_steps)))
            self.hist_steps = [self.hist_steps[i] for i in keep]
            self.hist_ab = [self.hist_ab[i] for i in keep]
            self.hist_S = [self.hist_S[i] for i in keep]
        self.hist_steps.append(int(step))
        self.hist_ab.append(ab.float())
        self.hist_S.append(s_tau.clone())

    def metrics(self) -> dict:
        """0-d tensors (and floats) for the trainer's log steps: mean reward and its spread over the
        global batch, mean policy entropy and (α, β), the timesteps of S at the last update, and the
        seconds spent in the look-ahead since the previous call (reading them is a sync on CUDA)."""
        out = dict(self._metrics)
        out["adaptive/lookahead_s"] = self.timer.read()
        return out

    def p_history(self, bins: int = 100) -> dict:
        """The learned p(t) over training for plots (host arrays): steps [U], p [U, bins] (bin k holds
        timesteps ⌊kT/bins⌋..⌊(k+1)T/bins⌋−1), S [U, n_select] timesteps, T."""
        import numpy as np

        p = [pol.timestep_probs(ab[:, 0], ab[:, 1], self.T, bins=bins).cpu().numpy() for ab in self.hist_ab]
        return {"steps": np.asarray(self.hist_steps, dtype=np.int64),
                "p": np.stack(p) if p else np.zeros((0, bins)),
                "S": (torch.stack(self.hist_S).cpu().numpy() if self.hist_S else np.zeros((0, self.n_select),
                                                                                          np.int64)),
                "T": self.T}

    # -- persistence -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        cpu = lambda v: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        opt = None
        if self.opt is not None:
            sd = self.opt.state_dict()
            opt = {"state": {k: {n: cpu(v) for n, v in s.items()} for k, s in sd["state"].items()},
                   "param_groups": copy.deepcopy(sd["param_groups"])}
        return {"in_shape": self.in_shape, "built": self.net is not None,
                "policy": None if self.net is None else {k: cpu(v) for k, v in self.net.state_dict().items()},
                "opt": opt, "fifo_X": cpu(self.fifo_X), "fifo_y": cpu(self.fifo_y), "fifo_count": self.fifo_count,
                "S": cpu(self.S), "updates": self.updates, "micro_step": self.micro_step,
                "ab": None if self._conc is None else cpu(self._conc[:AB_KEEP]),
                "hist_steps": list(self.hist_steps), "hist_ab": [cpu(v) for v in self.hist_ab],
                "hist_S": [cpu(v) for v in self.hist_S]}

    def load_state_dict(self, state: dict) -> None:
        dev = self.device
        if state["built"]:
            self._build(state["in_shape"])
            self.net.load_state_dict(state["policy"])
            if state["opt"] is not None:
                self.opt.load_state_dict(state["opt"])
        self.fifo_X, self.fifo_y = state["fifo_X"].to(dev), state["fifo_y"].to(dev)
        self.fifo_count, self.updates = int(state["fifo_count"]), int(state["updates"])
        self.micro_step = int(state["micro_step"])
        self.S = state["S"].to(dev)
        self._conc = None if state["ab"] is None else state["ab"].to(dev)
        self.hist_steps = list(state["hist_steps"])
        self.hist_ab = [v.to(dev) for v in state["hist_ab"]]
        self.hist_S = [v.to(dev) for v in state["hist_S"]]

    def to(self, device) -> Adaptive:
        super().to(device)  # the tensors held as attributes
        self.schedule = self.schedule.to(device)
        if self.net is not None:
            self.net.to(device)
            for s in self.opt.state.values():
                for k, v in s.items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        s[k] = v.to(device)
        self.hist_ab = [v.to(device) for v in self.hist_ab]
        self.hist_S = [v.to(device) for v in self.hist_S]
        self._tables = {}
        return self
