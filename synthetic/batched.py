"""Many small :class:`synthetic.model.FactRecallModel` trained at once, in one batched computation.

M models that share a task shape (N subjects, R relations, outputs, sequence length, attention kind) but may differ
in width d, MLP width m, seed, fact table and frozen parts are stacked into one set of parameters with a leading
model dimension [M, ...], zero-padded to the largest d and m. Every padded entry is zero and masked out of every
update, so each model is exactly its own width: a zero column of E, W_in, W_out or U adds exactly zero to every
product. Frozen parts (``frozen_subjects``, ``frozen_unembed``) are masked the same way, per model.

Each model keeps its own Adam moments, step count and learning-rate schedule (Adam is elementwise, so one stacked
update is M independent updates), its own stopping rule (``past_fit`` steps after its first step at
``target_acc``, None: that step; a model leaves the stack before the update of the step it stops at, exactly where
:func:`synthetic.train.train` stops, so it never changes again; the padding then shrinks to the widest model left)
and its own checkpoint directory (the files of :func:`synthetic.train.train`, so :func:`synthetic.train.load_run`
reads them and a rerun resumes).

``train_batched(tasks, configs, cfg)[i]`` equals ``train(tasks[i], model_config=configs[i], config=cfg)`` up to
float rounding (tests/test_batched.py), not bit for bit (the Adam update is written out, a bmm sums in another
order than an mm); where training is chaotic (the first step at 100% of a wide model) rounding moves that step, as
another thread count does. With ``config.chunk`` given, a model's numbers do not depend on which models of the same
width share its stack (the default chunk divides one L2-sized chunk among the M models). Full batch only. Times in each :class:`RunResult` are that model's *share*
of the batch (wall and CPU time of each step divided among the models in it), so they add up to the batch's time;
``time_to_target_s`` is the time from the batch's start to that model's 100%.
"""
from __future__ import annotations

import math
import os
import time

import torch

from synthetic.model import FactRecallModel, ModelConfig, softmax_cross_entropy
from synthetic.tasks import FactTask, KHopTask, SeqData
from synthetic.train import (
    CHECKPOINT,
    SNAPSHOT,
    STATE,
    RunResult,
    TrainConfig,
    _save_checkpoint,
    _save_task,
    denormals_flushed,
    evaluate,
    lr_at,
    read_checkpoint,
    run_result,
    save_run,
    snapshot,
    stop_now,
)

# the non-model axes of each parameter: "d" model width, "m" MLP width, "-" fixed by the task
AXES = {"subject_embed": "-d", "relation_embed": "-d", "pos": "-d", "W_Q": "dd", "W_K": "dd", "W_V": "dd",
        "W_O": "dd", "W_in": "dm", "b_in": "m", "W_out": "md", "b_out": "d", "unembed_weight": "-d",
        "unembed_bias": "-"}
SHARED = ("n_subjects", "n_relations", "n_outputs", "max_len", "attention", "pos_embed", "unembed_bias")


class ModelStack:
    """The parameters of M models, stacked [M, ...] and zero-padded to the widest d and m, with their update masks
    (1 = a real, trainable entry of that model), Adam moments and per-model step counts."""

    def __init__(self, models: list[FactRecallModel], device="cpu"):
        if not models:
            raise ValueError("no models to stack")
        first = models[0].config
        for m in models[1:]:
            diff = [k for k in SHARED if getattr(m.config, k) != getattr(first, k)]
            if diff:
                raise ValueError(f"models trained together must share {', '.join(diff)} "
                                 f"({getattr(m.config, diff[0])!r} vs {getattr(first, diff[0])!r})")
        self.configs = [m.config for m in models]
        self.names = [n for n, _ in models[0].named_parameters()]
        unknown = [n for n in self.names if n not in AXES]
        if unknown:
            raise ValueError(f"no stacking rule for parameters {unknown}")
        self.d = max(c.d_model for c in self.configs)
        self.m = max(c.d_mlp for c in self.configs)
        self.params, self.mask, self.exp_avg, self.exp_avg_sq = {}, {}, {}, {}
        for name in self.names:
            own = [dict(m.named_parameters())[name] for m in models]
            shape = self._padded(name, own[0].shape)
            P = torch.zeros(len(models), *shape, device=device)
            K = torch.zeros(len(models), *shape, device=device)
            for i, p in enumerate(own):
                region = (i,) + tuple(slice(0, s) for s in p.shape)
                P[region] = p.detach().to(device)
                K[region] = float(p.requires_grad)
            self.params[name] = P.requires_grad_(bool(K.any()))
            self.mask[name] = K
            self.exp_avg[name] = torch.zeros_like(P)
            self.exp_avg_sq[name] = torch.zeros_like(P)
        self.opt_steps = [0] * len(models)
        self.dense = self._dense()

    def _padded(self, name: str, shape) -> tuple[int, ...]:
        return tuple({"d": self.d, "m": self.m}.get(kind, size) for kind, size in zip(AXES[name], shape))

    def __len__(self) -> int:
        return len(self.configs)

    # ------------------------------------------------------------------ one model in or out
    def _region(self, i: int, name: str) -> tuple:
        c = self.configs[i]
        real = self.params[name].shape[1:]
        return (i,) + tuple(slice(0, {"d": c.d_model, "m": c.d_mlp}.get(kind, size))
                            for kind, size in zip(AXES[name], real))

    def model(self, i: int) -> FactRecallModel:
        """Model i as a plain :class:`FactRecallModel` (a copy of its unpadded parameters, on the stack's device)."""
        model = FactRecallModel(self.configs[i]).to(self.params[self.names[0]].device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self.params[name][self._region(i, name)])
        return model

    def tensor(self, i: int, name: str) -> torch.Tensor:
        """Model i's own (unpadded) parameter ``name``, a view into the stack."""
        return self.params[name].detach()[self._region(i, name)]

    def moments(self, i: int) -> dict:
        """Model i's Adam state {name: (exp_avg, exp_avg_sq, step)} for its trainable parameters."""
        model_params = dict(FactRecallModel(self.configs[i]).named_parameters())
        return {name: (self.exp_avg[name][self._region(i, name)], self.exp_avg_sq[name][self._region(i, name)],
                       self.opt_steps[i])
                for name in self.names if model_params[name].requires_grad and self.opt_steps[i] > 0}

    def set_moments(self, i: int, moments: dict) -> None:
        for name, (exp_avg, exp_avg_sq, steps) in moments.items():
            self.exp_avg[name][self._region(i, name)] = exp_avg
            self.exp_avg_sq[name][self._region(i, name)] = exp_avg_sq
            self.opt_steps[i] = int(steps)

    def load(self, i: int, model: FactRecallModel) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                self.params[name][self._region(i, name)] = p.detach()

    def keep(self, index: list[int]) -> None:
        """Keep only the models at ``index`` (in that order) and trim the padding to the widest of them."""
        self.configs = [self.configs[i] for i in index]
        self.opt_steps = [self.opt_steps[i] for i in index]
        self.d = max(c.d_model for c in self.configs)
        self.m = max(c.d_mlp for c in self.configs)
        rows = torch.tensor(index, device=self.params[self.names[0]].device)
        for name in self.names:
            cut = (rows,) + tuple(slice(0, s) for s in self._padded(name, self.params[name].shape[1:]))
            grad = self.params[name].requires_grad
            self.params[name] = self.params[name].detach()[cut].contiguous().requires_grad_(grad)
            for table in (self.mask, self.exp_avg, self.exp_avg_sq):
                table[name] = table[name][cut].contiguous()
        self.dense = self._dense()

    def _dense(self) -> dict[str, bool]:
        """Name -> is its mask all ones (every model trains it, no padding): its update skips the masking."""
        return {name: bool(mask.all()) for name, mask in self.mask.items()}

    # ------------------------------------------------------------------ forward
    def final_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Residual stream after the block at ``positions`` [M, b, k, D] for input ids [M, b, t] (model i reads
        ids[i]); mirrors :meth:`FactRecallModel.final_states` with a leading model dimension."""
        P, c = self.params, self.configs[0]
        M, b, t = input_ids.shape
        table = torch.cat([P["subject_embed"], P["relation_embed"]], dim=1)          # [M, V, D]
        offset = torch.arange(M, device=input_ids.device)[:, None, None] * table.shape[1]
        x = torch.nn.functional.embedding(input_ids + offset, table.reshape(-1, self.d))   # [M, b, t, D]
        if c.pos_embed:
            x = x + P["pos"][:, None, :t]
        if c.attention == "uniform":
            if t == 2 and positions.numel() == 1 and int(positions[0]) == 1:
                attn = ((x[:, :, 0] + x[:, :, 1]) * 0.5)[:, :, None]
            else:
                attn = x.cumsum(dim=2)[:, :, positions] / (positions + 1).to(x.dtype)[None, None, :, None]
        else:
            q = _per_model(x[:, :, positions], P["W_Q"])
            k, v = _per_model(x, P["W_K"]), _per_model(x, P["W_V"])
            scale = torch.tensor([math.sqrt(cfg.d_model) for cfg in self.configs], device=x.device)
            scores = q @ k.transpose(-1, -2) / scale[:, None, None, None]
            mask = torch.arange(t, device=x.device)[None, :] > positions.to(x.device)[:, None]
            attn = _per_model(torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v, P["W_O"])
        mid = x[:, :, positions] + attn
        hidden = (_per_model(mid, P["W_in"]) + P["b_in"][:, None, None]).relu_()    # in place: no [M, b, k, m] copy
        return mid + _per_model(hidden, P["W_out"]) + P["b_out"][:, None, None]

    def loss(self, input_ids, positions, targets, chunk=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-model mean cross-entropy [M] and number of correct predictions [M] (strict argmax) for targets
        [M, b, k]; the sum of the losses backpropagates each model's own gradient into its own slice."""
        M = input_ids.shape[0]
        h = self.final_states(input_ids, positions).reshape(M, -1, self.d)
        bias = self.params.get("unembed_bias")
        return softmax_cross_entropy(h, self.params["unembed_weight"], bias, targets.reshape(M, -1), chunk)

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def adam_step(self, lrs: list[float], cfg: TrainConfig) -> None:
        """One Adam update of every model (torch.optim.Adam's arithmetic, L2 weight decay as there), with model i's
        learning rate ``lrs[i]`` and its own bias correction; masked entries get no gradient and so never move."""
        b1, b2 = cfg.betas
        device = self.params[self.names[0]].device
        self.opt_steps = [s + 1 for s in self.opt_steps]
        view = (-1,)
        step_size = torch.tensor([lr / (1 - b1 ** s) for lr, s in zip(lrs, self.opt_steps)], device=device)
        bc2_sqrt = torch.tensor([math.sqrt(1 - b2 ** s) for s in self.opt_steps], device=device)
        for name in self.names:
            p = self.params[name]
            if p.grad is None:
                continue
            shape = view + (1,) * (p.dim() - 1)
            g = p.grad if not cfg.weight_decay else p.grad.add(p, alpha=cfg.weight_decay)
            if not self.dense[name]:            # a mask of ones would multiply by exactly 1
                g.mul_(self.mask[name])
            self.exp_avg[name].lerp_(g, 1 - b1)
            self.exp_avg_sq[name].mul_(b2).addcmul_(g, g, value=1 - b2)
            # g is spent: the rest is computed in its memory, op for op as
            # p -= exp_avg / (sqrt(exp_avg_sq) / bc2_sqrt + eps) * step_size, with no new [M, ...] tensor
            denom = torch.sqrt(self.exp_avg_sq[name], out=g).div_(bc2_sqrt.view(shape)).add_(cfg.eps)
            p.sub_(torch.div(self.exp_avg[name], denom, out=denom).mul_(step_size.view(shape)))
            p.grad = None


def _per_model(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, b, k, p] times model i's own weight [M, p, q] -> [M, b, k, q] (one bmm, not b * k small ones)."""
    M, b, k, p = x.shape
    return torch.bmm(x.reshape(M, b * k, p), weight).reshape(M, b, k, weight.shape[2])


def train_batched(tasks: list[FactTask | KHopTask], model_configs: list[ModelConfig],
                  config: TrainConfig | None = None, out_dirs: list[str | None] | None = None,
                  resume: bool = True, snapshot_at: tuple[int, ...] = ()) -> list[RunResult]:
    """Train ``model_configs[i]`` on ``tasks[i]`` for every i at once (full batch, each until its stopping rule:
    ``config.past_fit`` steps past its first step at ``config.target_acc``, None: that step; or
    ``config.max_steps``); returns one :class:`RunResult` per model, in order, with the trained model at
    ``result.model`` and the ``snapshot_at`` copies at ``result.snapshots`` (as :func:`synthetic.train.train`).
    ``out_dirs[i]``: checkpoint directory of model i (resumed when it holds a checkpoint and ``resume``). Every task
    must give data of one shape (same N, R, sequence length)."""
    cfg = config or TrainConfig()
    if len(tasks) != len(model_configs):
        raise ValueError(f"{len(tasks)} tasks but {len(model_configs)} model configs")
    out_dirs = list(out_dirs) if out_dirs is not None else [None] * len(tasks)
    if len(out_dirs) != len(tasks):
        raise ValueError(f"{len(tasks)} tasks but {len(out_dirs)} output directories")
    if cfg.threads and cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    datas = _stackable_data(tasks, cfg, device)
    models = [FactRecallModel(c).to(device) for c in model_configs]
    batch = _Batch(tasks, datas, models, out_dirs, cfg, device, snapshot_at)
    batch.resume(models, resume)
    batch.start_clock()
    batch.leave_finished()
    with denormals_flushed(cfg.flush_denormals):
        batch.train()
    return batch.results


def _stackable_data(tasks: list, cfg: TrainConfig, device) -> list[SeqData]:
    """Each task's data on ``device``; ValueError unless they share one shape and ``cfg`` asks for full batches."""
    datas = [task.data().to(device) for task in tasks]
    shapes = {(tuple(d.input_ids.shape), tuple(d.target_pos.tolist()), tuple(d.targets.shape)) for d in datas}
    if len(shapes) > 1:
        raise ValueError(f"tasks trained together must give data of one shape, got {sorted(shapes)}")
    n_rows = len(datas[0])
    if cfg.batch_size and cfg.batch_size < n_rows:
        raise ValueError(f"batched training is full batch only: batch_size {cfg.batch_size} < {n_rows} facts "
                         f"(use synthetic.train.train for minibatches)")
    return datas


class _Batch:
    """One :func:`train_batched` call: the :class:`ModelStack` of the models still training and, per model i (its
    original index), its step count, history, latest loss and accuracy, fit (step, seconds), time shares,
    snapshots and, once it has left the stack, its result. ``active``: the original index of each model in the
    stack, in stack order (row j of the stack is model ``active[j]``)."""

    def __init__(self, tasks: list, datas: list[SeqData], models: list[FactRecallModel], out_dirs: list,
                 cfg: TrainConfig, device, snapshot_at: tuple[int, ...]):
        M = len(models)
        self.tasks, self.datas, self.out_dirs, self.cfg, self.snapshot_at = tasks, datas, out_dirs, cfg, snapshot_at
        self.M, self.n_rows, self.positions = M, len(datas[0]), datas[0].target_pos
        self.steps, self.histories, self.fit_steps = [0] * M, [[] for _ in range(M)], [None] * M
        self.accs, self.losses = [0.0] * M, [float("nan")] * M
        self.wall_share, self.cpu_share = [0.0] * M, [0.0] * M
        self.snapshots: list[dict[int, dict]] = [{} for _ in range(M)]
        self.stack = ModelStack(models, device)
        self.results: list[RunResult | None] = [None] * M
        self.fit_times: list[float | None] = [None] * M
        self.active = list(range(M))
        self.t0 = self.last_ckpt = time.perf_counter()

    def resume(self, models: list[FactRecallModel], resume: bool) -> None:
        """Each model with a checkpoint in its directory (and ``resume``) continues from it: parameters, Adam
        moments and counts; a fresh directory gets the task file."""
        cfg = self.cfg
        for i, out_dir in enumerate(self.out_dirs):
            if not out_dir:
                continue
            os.makedirs(out_dir, exist_ok=True)
            if resume and (os.path.exists(os.path.join(out_dir, STATE)) or os.path.exists(
                    os.path.join(out_dir, CHECKPOINT))):
                state, moments = read_checkpoint(out_dir, models[i])
                self.stack.load(i, models[i])
                self.stack.set_moments(i, moments)
                self.steps[i], self.histories[i], self.wall_share[i] = state["step"], state["history"], state["elapsed"]
                self.accs[i], self.losses[i] = state.get("accuracy", 0.0), state.get("loss", float("nan"))
                fitted = self.accs[i] >= cfg.target_acc and self.steps[i] > 0
                self.fit_steps[i] = state.get("fit_step", self.steps[i] if fitted else None)
            else:
                _save_task(self.tasks[i], out_dir)

    def start_clock(self) -> None:
        """The batch's time starts (after the resume): the fit times count from here, the checkpoint interval too."""
        self.t0, self.last_ckpt = time.perf_counter(), time.perf_counter()

    def finish(self, j: int, i: int, confirmed: bool) -> None:
        """Model i (row j of the stack) is finished: evaluate unless ``confirmed`` (stopped at its fit), record,
        save."""
        cfg, model = self.cfg, self.stack.model(j)
        if not confirmed:
            self.accs[i] = evaluate(model, self.datas[i])       # the parameters it ends with
        if self.fit_steps[i] is None and self.accs[i] >= cfg.target_acc:
            self.fit_steps[i], self.fit_times[i] = self.steps[i], time.perf_counter() - self.t0   # the last update
            if 0 in self.snapshot_at:
                self.snapshots[i][0] = snapshot(model)
        if not self.histories[i] or self.histories[i][-1][0] != self.steps[i]:
            self.histories[i].append([self.steps[i], round(self.losses[i], 5), round(self.accs[i], 5)])
        self.results[i] = run_result(
            self.tasks[i], model, cfg, steps=self.steps[i], accuracy=self.accs[i], loss=self.losses[i],
            history=self.histories[i], wall_s=self.wall_share[i], cpu_s=self.cpu_share[i],
            time_to_target_s=self.fit_times[i], facts_per_step=self.n_rows, fit_step=self.fit_steps[i],
            batch_models=self.M)
        self.results[i].snapshots = self.snapshots[i]
        if self.out_dirs[i]:
            save_run(self.out_dirs[i], self.results[i], self.stack.moments(j), self.wall_share[i], cfg)

    def save_all(self) -> None:
        """A checkpoint of every model still in the stack that has a directory."""
        for j, i in enumerate(self.active):
            if self.out_dirs[i]:
                _save_checkpoint(self.out_dirs[i], self.stack.model(j), self.stack.moments(j), self.steps[i],
                                 self.wall_share[i], self.histories[i], self.accs[i], self.losses[i], self.cfg,
                                 self.fit_steps[i])

    def leave_finished(self) -> None:
        """Models already finished in their checkpoint (as train(): by the stopping rule, or at the step cap) get
        their results and leave the stack."""
        cfg, active, steps, fit_steps = self.cfg, self.active, self.steps, self.fit_steps
        leave = [j for j, i in enumerate(active)
                 if (fit_steps[i] is not None and stop_now(steps[i] - fit_steps[i], cfg)) or steps[i] >= cfg.max_steps]
        for j in leave:
            self.finish(j, active[j], fit_steps[active[j]] is not None and cfg.past_fit is None)
        self.active = [i for j, i in enumerate(active) if j not in leave]
        if leave and self.active:
            self.stack.keep([j for j in range(len(self.stack)) if j not in leave])

    def stacked_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [M, F, L] and targets [M, F, T] of the stack's models, in stack order."""
        return (torch.stack([self.datas[i].input_ids for i in self.active]),
                torch.stack([self.datas[i].targets for i in self.active]))

    def train(self) -> None:
        """Steps until every model has left the stack (by its stopping rule or the step cap); Ctrl-C saves every
        checkpoint first."""
        cfg = self.cfg
        ids, targets = self.stacked_data() if self.active else (None, None)
        try:
            while self.active:
                loss, leave = self.measure(ids, targets)
                for j in leave:                    # done before this step's update: it never changes again
                    self.finish(j, self.active[j], cfg.past_fit is None)
                stay = self.update(loss, leave)
                capped = [j for j in stay if self.steps[self.active[j]] >= cfg.max_steps]
                for j in capped:
                    self.finish(j, self.active[j], False)
                if self.drop(set(leave) | set(capped)):
                    ids, targets = self.stacked_data()
                if any(self.out_dirs) and self.active and time.perf_counter() - self.last_ckpt > cfg.checkpoint_every_s:
                    self.save_all()
                    self.last_ckpt = time.perf_counter()
        except KeyboardInterrupt:
            self.save_all()                  # the next call on these directories resumes from here
            raise

    def measure(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The stack's forward pass on ids [M, F, L], targets [M, F, T]: each model's loss and accuracy before the
        update, its fit, snapshots and stopping rule; returns (the losses [M], the rows j that stop here)."""
        wall0, cpu0 = time.perf_counter(), time.process_time()
        loss, correct = self.stack.loss(ids, self.positions, targets, chunk=self.cfg.chunk)
        n_pred = targets[0].numel()
        step_losses, step_correct = loss.detach().tolist(), correct.tolist()     # one copy each, not M
        leave = [j for j, i in enumerate(self.active) if self.stops(j, i, step_losses[j], step_correct[j] / n_pred)]
        dt_wall, dt_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        for i in self.active:
            self.wall_share[i] += dt_wall / len(self.active)
            self.cpu_share[i] += dt_cpu / len(self.active)
        return loss, leave

    def stops(self, j: int, i: int, loss: float, acc: float) -> bool:
        """Model i (row j) at this step: its ``loss`` and accuracy ``acc`` (before the update, as in train();
        confirmed by a plain argmax pass at the target), its fit and snapshot; True: its stopping rule is met."""
        cfg = self.cfg
        self.losses[i] = loss
        self.accs[i] = acc
        if self.fit_steps[i] is None and self.accs[i] >= cfg.target_acc:
            self.accs[i] = evaluate(self.stack.model(j), self.datas[i])   # confirm with a plain argmax pass
            if self.accs[i] >= cfg.target_acc:
                self.fit_steps[i], self.fit_times[i] = self.steps[i], time.perf_counter() - self.t0
        if self.fit_steps[i] is None:
            return False
        past = self.steps[i] - self.fit_steps[i]
        if past in self.snapshot_at:
            self.snapshots[i][past] = {name: self.stack.tensor(j, name).cpu().clone() for name in SNAPSHOT}
        return stop_now(past, cfg)

    def update(self, loss: torch.Tensor, leave: list[int]) -> list[int]:
        """One Adam step of the rows that stay (not in ``leave``), their counts and history; returns those rows."""
        cfg = self.cfg
        wall0, cpu0 = time.perf_counter(), time.process_time()
        stay = [j for j in range(len(self.active)) if j not in leave]
        if stay:
            loss.sum().backward()
            self.stack.adam_step([lr_at(self.steps[i], cfg) for i in self.active], cfg)
        for j in stay:
            i = self.active[j]
            self.steps[i] += 1
            if self.steps[i] % cfg.log_every == 0:
                self.histories[i].append([self.steps[i], round(self.losses[i], 5), round(self.accs[i], 5)])
        dt_wall, dt_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        for j in stay:
            self.wall_share[self.active[j]] += dt_wall / len(stay)
            self.cpu_share[self.active[j]] += dt_cpu / len(stay)
        return stay

    def drop(self, gone: set[int]) -> bool:
        """The rows ``gone`` leave the stack (its padding trimmed); True: models are left, their data to restack."""
        if not gone:
            return False
        keep = [j for j in range(len(self.active)) if j not in gone]
        self.active = [self.active[j] for j in keep]
        if keep:
            self.stack.keep(keep)
        return bool(keep)
