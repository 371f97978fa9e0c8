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
from synthetic.tasks import FactTask, KHopTask
from synthetic.train import (
    CHECKPOINT,
    SNAPSHOT,
    STATE,
    RunResult,
    TrainConfig,
    _save_checkpoint,
    _save_task,
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
        hidden = torch.relu(_per_model(mid, P["W_in"]) + P["b_in"][:, None, None])
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
            g = g * self.mask[name]
            self.exp_avg[name].lerp_(g, 1 - b1)
            self.exp_avg_sq[name].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (self.exp_avg_sq[name].sqrt() / bc2_sqrt.view(shape)).add_(cfg.eps)
            p.sub_(self.exp_avg[name] / denom * step_size.view(shape))
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
    datas = [task.data().to(device) for task in tasks]
    shapes = {(tuple(d.input_ids.shape), tuple(d.target_pos.tolist()), tuple(d.targets.shape)) for d in datas}
    if len(shapes) > 1:
        raise ValueError(f"tasks trained together must give data of one shape, got {sorted(shapes)}")
    n_rows = len(datas[0])
    if cfg.batch_size and cfg.batch_size < n_rows:
        raise ValueError(f"batched training is full batch only: batch_size {cfg.batch_size} < {n_rows} facts "
                         f"(use synthetic.train.train for minibatches)")
    models = [FactRecallModel(c).to(device) for c in model_configs]
    M = len(models)
    steps, histories, fit_steps = [0] * M, [[] for _ in range(M)], [None] * M
    accs, losses = [0.0] * M, [float("nan")] * M
    wall_share, cpu_share = [0.0] * M, [0.0] * M
    snapshots: list[dict[int, dict]] = [{} for _ in range(M)]
    stack = ModelStack(models, device)
    for i, out_dir in enumerate(out_dirs):
        if not out_dir:
            continue
        os.makedirs(out_dir, exist_ok=True)
        if resume and (os.path.exists(os.path.join(out_dir, STATE)) or os.path.exists(
                os.path.join(out_dir, CHECKPOINT))):
            state, moments = read_checkpoint(out_dir, models[i])
            stack.load(i, models[i])
            stack.set_moments(i, moments)
            steps[i], histories[i], wall_share[i] = state["step"], state["history"], state["elapsed"]
            accs[i], losses[i] = state.get("accuracy", 0.0), state.get("loss", float("nan"))
            fit_steps[i] = state.get("fit_step", steps[i] if accs[i] >= cfg.target_acc and steps[i] > 0 else None)
        else:
            _save_task(tasks[i], out_dir)

    results: list[RunResult | None] = [None] * M
    t0, last_ckpt = time.perf_counter(), time.perf_counter()
    fit_times: list[float | None] = [None] * M
    active = list(range(M))                  # original index of each model in the stack, in stack order

    def finish(j: int, i: int, confirmed: bool) -> None:
        """Model i (row j of the stack) is finished: evaluate unless ``confirmed`` (stopped at its fit), record,
        save."""
        model = stack.model(j)
        if not confirmed:
            accs[i] = evaluate(model, datas[i])       # the parameters it ends with
        if fit_steps[i] is None and accs[i] >= cfg.target_acc:
            fit_steps[i], fit_times[i] = steps[i], time.perf_counter() - t0     # reached with the last update
            if 0 in snapshot_at:
                snapshots[i][0] = snapshot(model)
        if not histories[i] or histories[i][-1][0] != steps[i]:
            histories[i].append([steps[i], round(losses[i], 5), round(accs[i], 5)])
        results[i] = run_result(tasks[i], model, cfg, steps=steps[i], accuracy=accs[i], loss=losses[i],
                                history=histories[i], wall_s=wall_share[i], cpu_s=cpu_share[i],
                                time_to_target_s=fit_times[i], facts_per_step=n_rows, fit_step=fit_steps[i],
                                batch_models=M)
        results[i].snapshots = snapshots[i]
        if out_dirs[i]:
            save_run(out_dirs[i], results[i], stack.moments(j), wall_share[i], cfg)

    def save_all() -> None:
        for j, i in enumerate(active):
            if out_dirs[i]:
                _save_checkpoint(out_dirs[i], stack.model(j), stack.moments(j), steps[i], wall_share[i],
                                 histories[i], accs[i], losses[i], cfg, fit_steps[i])

    # models already finished in their checkpoint (as train(): by the stopping rule, or at the step cap)
    leave = [j for j, i in enumerate(active) if (fit_steps[i] is not None and stop_now(steps[i] - fit_steps[i], cfg))
             or steps[i] >= cfg.max_steps]
    for j in leave:
        finish(j, active[j], fit_steps[active[j]] is not None and cfg.past_fit is None)
    active = [i for j, i in enumerate(active) if j not in leave]
    if leave and active:
        stack.keep([j for j in range(len(stack)) if j not in leave])
    positions = datas[0].target_pos

    def stacked_data() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.stack([datas[i].input_ids for i in active]), torch.stack([datas[i].targets for i in active]))

    ids, targets = stacked_data() if active else (None, None)     # [M, F, L], [M, F, T] of the stack's models
    try:
        while active:
            wall0, cpu0 = time.perf_counter(), time.process_time()
            loss, correct = stack.loss(ids, positions, targets, chunk=cfg.chunk)
            n_pred = targets[0].numel()
            leave = []
            step_losses, step_correct = loss.detach().tolist(), correct.tolist()     # one copy each, not M
            for j, i in enumerate(active):
                losses[i] = step_losses[j]
                accs[i] = step_correct[j] / n_pred          # accuracy before the update, as in train()
                if fit_steps[i] is None and accs[i] >= cfg.target_acc:
                    accs[i] = evaluate(stack.model(j), datas[i])   # confirm with a plain argmax pass
                    if accs[i] >= cfg.target_acc:
                        fit_steps[i], fit_times[i] = steps[i], time.perf_counter() - t0
                if fit_steps[i] is not None:
                    if steps[i] - fit_steps[i] in snapshot_at:
                        snapshots[i][steps[i] - fit_steps[i]] = {name: stack.tensor(j, name).cpu().clone()
                                                                 for name in SNAPSHOT}
                    if stop_now(steps[i] - fit_steps[i], cfg):
                        leave.append(j)
            dt_wall, dt_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            for i in active:
                wall_share[i] += dt_wall / len(active)
                cpu_share[i] += dt_cpu / len(active)
            for j in leave:                    # done before this step's update: it never changes again
                finish(j, active[j], cfg.past_fit is None)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            stay = [j for j in range(len(active)) if j not in leave]
            if stay:
                loss.sum().backward()
                stack.adam_step([lr_at(steps[i], cfg) for i in active], cfg)
            for j in stay:
                i = active[j]
                steps[i] += 1
                if steps[i] % cfg.log_every == 0:
                    histories[i].append([steps[i], round(losses[i], 5), round(accs[i], 5)])
            dt_wall, dt_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            for j in stay:
                wall_share[active[j]] += dt_wall / len(stay)
                cpu_share[active[j]] += dt_cpu / len(stay)
            capped = [j for j in stay if steps[active[j]] >= cfg.max_steps]
            for j in capped:
                finish(j, active[j], False)
            gone = set(leave) | set(capped)
            if gone:
                keep = [j for j in range(len(active)) if j not in gone]
                active = [active[j] for j in keep]
                if keep:
                    stack.keep(keep)
                    ids, targets = stacked_data()
            if any(out_dirs) and active and time.perf_counter() - last_ckpt > cfg.checkpoint_every_s:
                save_all()
                last_ckpt = time.perf_counter()
    except KeyboardInterrupt:
        save_all()                  # the next call on these directories resumes from here
        raise
    return results
