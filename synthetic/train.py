"""Training of :class:`synthetic.model.FactRecallModel` to 100% train accuracy.

Recipe (defaults of :class:`TrainConfig`): Adam (lr 0.1, betas (0.9, 0.98), no weight decay), full batch over
every fact (or minibatches of ``batch_size``), learning rate with a linear warm-up over the first 10% of
``max_steps`` and cosine decay to ``lr * min_lr_frac``, and stop as soon as every training prediction is the
argmax (``target_acc`` = 1.0). In full-batch mode the accuracy comes for free from the step's own forward pass
(parameters *before* the update, confirmed by a plain argmax pass, and that update is then not applied, so the
saved model is the one that scored 100%); in minibatch mode a full evaluation runs at the end of each epoch.

Stopping rule (``past_fit``): None stops at that first 100% step (``fit_step``, the capacity sweep's rule: d* asks
only whether the facts fit); an integer k trains k more steps past it (at most to ``max_steps``, the schedule
unchanged), which the matched controls use, since a wide model fits after a few dozen steps with its embeddings
barely off their random init. ``snapshot_at`` (steps past the fit) keeps copies of the subject embeddings and the
unembedding there (``result.snapshots``), so one run gives the readouts at several budgets.

Checkpoints (``out_dir``): ``checkpoint.safetensors`` holds the parameters, the flattened Adam moments
(``opt.<name>.exp_avg`` / ``opt.<name>.exp_avg_sq``) and, in its metadata, the step, configs and history: one file
written atomically, so weights and optimizer state can never come from different steps. ``checkpoint.json``
repeats that state for readers (a resume reads the safetensors file; older checkpoints without the metadata fall
back to it), and ``task.json`` holds the fact table. All writes are atomic (temp file + ``os.replace``).
A run started on a directory that holds a checkpoint resumes from it (``resume=False`` starts over). ``run.json``
records the result: accuracy, steps, wall time, parameter counts and bits per trainable parameter. The batched
trainer (:mod:`synthetic.batched`) builds its results with the same :func:`run_result` and saves them with the same
:func:`save_run`; its loop is its own (its Adam update is written out, so it is not bit-identical to this one).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from llmprobe import console
from llmprobe.checks import UsageError, check_fields, parse_json, read_json
from llmprobe.io import write_bytes, write_json
from synthetic.model import FactRecallModel, ModelConfig
from synthetic.tasks import FactTask, KHopTask, SeqData, id_tensor

CHECKPOINT = "checkpoint.safetensors"
STATE = "checkpoint.json"
RUN = "run.json"
TASK = "task.json"


@dataclass
class TrainConfig:
    lr: float = 0.1
    max_steps: int = 2000
    batch_size: int | None = None        # None = full batch (all facts every step)
    warmup_frac: float = 0.1
    min_lr_frac: float = 0.01
    schedule: str = "cosine"             # "cosine" | "constant"
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 0.0
    target_acc: float = 1.0
    past_fit: int | None = None          # steps trained past the first step at target_acc; None = stop there
    chunk: int | None = None             # rows per softmax chunk; None = auto (L2-sized on CPU)
    seed: int = 0                        # data order (minibatch mode)
    device: str = "cpu"
    threads: int | None = None           # torch.set_num_threads on CPU (None = leave)
    checkpoint_every_s: float = 120.0
    log_every: int = 50                  # history granularity (steps)
    progress: bool = True
    flush_denormals: bool = True         # CPU: denormal floats flushed to zero while training (denormals_flushed)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: dict) -> "TrainConfig":
        known = {k: v for k, v in obj.items() if k in cls.__dataclass_fields__}
        if "betas" in known:
            known["betas"] = tuple(known["betas"])
        return cls(**known)


@dataclass
class RunResult:
    """What one training run achieved. ``bits`` is the information in the fact table (R*log2(N!) for R random
    bijections; see :meth:`synthetic.tasks.FactTask.bits`), ``bits_per_param`` = bits / trainable parameters."""

    accuracy: float
    success: bool
    steps: int
    wall_time_s: float
    n_params: int
    n_trainable: int
    bits: float
    bits_per_param: float
    loss: float
    facts_per_s: float
    n_subjects: int
    n_relations: int
    d_model: int
    d_mlp: int
    frozen_subjects: bool
    attention: str
    task_kind: str
    train: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    time_to_target_s: float | None = None
    cpu_time_s: float | None = None          # process CPU time of this call (robust to other load on the machine)
    batch_models: int = 1                    # models trained together (synthetic.batched); times are shares then
    fit_step: int | None = None              # first step whose parameters reached target_acc (None: never)

    def to_dict(self) -> dict:
        return asdict(self)


def flushing_denormals() -> bool:
    """Whether this thread flushes denormal floats to zero: 1e-39 (a float32 denormal) converted reads 0."""
    return float(torch.tensor(1e-39, dtype=torch.float32)) == 0.0


@contextlib.contextmanager
def denormals_flushed(on: bool = True):
    """Within the block this thread flushes denormal floats to zero (the CPU's FTZ and DAZ modes) when ``on``, and
    after it is in the mode it was before; ``on`` False changes nothing. Only this thread: torch's intra-op threads
    keep theirs (the matched controls train on one thread). A model past its fit has softmax probabilities below
    float32's normal range; their denormal gradients flow through every matmul of a step, which the CPU computes
    several times slower (measured: 71 -> 24 ms a step at d = 64 with 3 models on 1200 facts, 300 steps, most past
    the fit). Flushing moves no result of an operation by more than float32's smallest normal (1.2e-38), but a
    trajectory trained this way can differ in its last bits from one trained with them
    (``TrainConfig.flush_denormals=False``). No effect on CUDA."""
    if not on:
        yield
        return
    before = flushing_denormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for ``step`` (0-based): linear warm-up, then cosine to ``lr * min_lr_frac``."""
    if cfg.schedule == "constant":
        return cfg.lr
    warm = max(1, int(cfg.warmup_frac * cfg.max_steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, cfg.max_steps - warm))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def model_config_for(task: FactTask | KHopTask, d_model: int, **kw) -> ModelConfig:
    """A :class:`ModelConfig` sized for ``task`` (subjects, relations, outputs, sequence length)."""
    max_len = task.seq_len if isinstance(task, KHopTask) else 2
    return ModelConfig(n_subjects=task.n_subjects, n_relations=task.n_relations, n_outputs=task.n_outputs,
                       d_model=d_model, max_len=max_len, **kw)


def evaluate(model: FactRecallModel, data: SeqData, chunk: int = 8192) -> float:
    """Fraction of target predictions (all positions) that are the argmax."""
    pred = model.predict(data.input_ids, data.target_pos, chunk=chunk)
    return float((pred == data.targets).float().mean()) if data.n_predictions else 1.0


def train(task: FactTask | KHopTask, d_model: int | None = None, *, model_config: ModelConfig | None = None,
          config: TrainConfig | None = None, out_dir: str | None = None, resume: bool = True,
          model: FactRecallModel | None = None, callback=None, snapshot_at: tuple[int, ...] = (),
          **model_kw) -> RunResult:
    """Train a one-layer model on every fact of ``task`` until the stopping rule (``config.past_fit`` steps past
    the first step at 100% train accuracy; None: that step) or ``config.max_steps``.

    Give ``d_model`` (other architecture settings as keywords, e.g. ``frozen_subjects=True``,
    ``attention="learned"``, ``d_mlp=64``), a full ``model_config``, or a ready ``model``. With ``out_dir`` the run
    checkpoints there and resumes from an existing checkpoint (Ctrl-C saves a checkpoint before it propagates).
    ``callback(step, loss, accuracy)`` runs after every update; returning True stops there (resumable).
    ``snapshot_at``: steps past the fit at which to keep the subject embeddings and unembedding
    (``result.snapshots`` {k: {name: tensor}}, :func:`snapshot`; not kept across a resume).
    The trained model is ``result.model``.
    """
    cfg = config or TrainConfig()
    if cfg.threads and cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    if model is None:
        model = FactRecallModel(_model_config(task, d_model, model_config, model_kw))
    device = torch.device(cfg.device)
    model.to(device)
    data = task.data().to(device)
    n_rows = len(data)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.Adam(params.values(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    run = _start(task, model, opt, params, cfg, out_dir, resume)
    bs = n_rows if not cfg.batch_size else min(cfg.batch_size, n_rows)
    bar = _progress(cfg, run.step)
    run.t0 = time.perf_counter() - run.elapsed
    cpu0 = time.process_time()
    run.done = run.fit_step is not None and stop_now(run.step - run.fit_step, cfg)

    def save():
        _save_checkpoint(out_dir, model, adam_moments(opt, params), run.step, time.perf_counter() - run.t0,
                         run.history, run.acc, run.loss, cfg, run.fit_step)

    with denormals_flushed(cfg.flush_denormals):
        try:
            _steps(run, model, opt, data, bs, cfg, snapshot_at, bar, save if out_dir else None, callback)
        except KeyboardInterrupt:
            if out_dir:   # keep what was done; the next call on out_dir resumes from here
                save()
            raise
        finally:
            if bar is not None:
                bar.close()
        _conclude(run, model, data, cfg, snapshot_at)
    wall = time.perf_counter() - run.t0
    result = run_result(task, model, cfg, steps=run.step, accuracy=run.acc, loss=run.loss, history=run.history,
                        wall_s=wall, cpu_s=time.process_time() - cpu0, time_to_target_s=run.t_target,
                        facts_per_step=bs, fit_step=run.fit_step)
    result.snapshots = run.snapshots
    if out_dir:
        save_run(out_dir, result, adam_moments(opt, params), wall, cfg)
    return result


@dataclass
class _RunState:
    """Where one :func:`train` run stands: the step count, its history rows [step, loss, accuracy], the latest
    loss and accuracy, the fit (``fit_step``, ``t_target`` seconds after ``t0``), the snapshots kept and whether
    the stopping rule was met (``done``)."""
    step: int = 0
    elapsed: float = 0.0
    history: list = field(default_factory=list)
    acc: float = 0.0
    loss: float = float("nan")
    t_target: float | None = None
    fit_step: int | None = None
    snapshots: dict = field(default_factory=dict)
    done: bool = False
    t0: float = 0.0

    def record(self) -> None:
        self.history.append([self.step, round(self.loss, 5), round(self.acc, 5)])

    def fit_now(self) -> None:
        """This step (its parameters) reached the target accuracy."""
        self.fit_step, self.t_target = self.step, time.perf_counter() - self.t0

    def keep_snapshot(self, model: FactRecallModel, snapshot_at: tuple[int, ...]) -> None:
        """A :func:`snapshot` of ``model`` when the steps past the fit are one of ``snapshot_at``."""
        if self.step - self.fit_step in snapshot_at:
            self.snapshots[self.step - self.fit_step] = snapshot(model)


def _model_config(task, d_model: int | None, model_config: ModelConfig | None, model_kw: dict) -> ModelConfig:
    """``model_config``, else the config of width ``d_model`` sized for ``task`` (ValueError: neither given)."""
    if model_config is None:
        if d_model is None:
            raise ValueError("give d_model, model_config or model")
        model_config = model_config_for(task, d_model, **model_kw)
    return model_config


def _start(task, model, opt, params: dict, cfg: TrainConfig, out_dir: str | None, resume: bool) -> _RunState:
    """A fresh :class:`_RunState`, or (``out_dir`` holds a checkpoint, ``resume``) the checkpoint's, its parameters and
    Adam moments loaded into ``model`` and ``opt``; a fresh ``out_dir`` gets the task file."""
    run = _RunState()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        if resume and (os.path.exists(os.path.join(out_dir, STATE)) or _checkpoint_state(out_dir)):
            state = _load_checkpoint(out_dir, model, opt, params)
            run.step, run.elapsed, run.history = state["step"], state["elapsed"], state["history"]
            run.acc, run.loss = state.get("accuracy", 0.0), state.get("loss", float("nan"))
            run.fit_step = state.get("fit_step", run.step if run.acc >= cfg.target_acc and run.step > 0 else None)
        else:
            _save_task(task, out_dir)
    return run


def _steps(run: _RunState, model, opt, data: SeqData, bs: int, cfg: TrainConfig, snapshot_at, bar, save, callback):
    """The training loop: Adam steps on batches of ``bs`` rows until the stopping rule, ``cfg.max_steps`` or
    ``callback`` says stop; the history, progress bar and checkpoints (``save``, None: none) kept on the way."""
    n_rows = len(data)
    full_batch = bs >= n_rows
    steps_per_epoch = math.ceil(n_rows / bs)
    last_ckpt = time.perf_counter()
    perm, correct_epoch = None, 0
    while not run.done and run.step < cfg.max_steps:
        if full_batch:
            ids, tgt = data.input_ids, data.targets
        else:
            ids, tgt, perm = _minibatch(data, run.step, steps_per_epoch, bs, perm, cfg)
        for group in opt.param_groups:
            group["lr"] = lr_at(run.step, cfg)
        loss, correct = model.loss(ids, data.target_pos, tgt, chunk=cfg.chunk)
        run.loss = float(loss.detach())
        if full_batch and _fits_before_update(run, model, data, int(correct) / tgt.numel(), cfg, snapshot_at):
            break                                      # this step's update is not applied
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run.step += 1
        if not full_batch:
            correct_epoch = _after_minibatch(run, model, data, correct_epoch + int(correct), steps_per_epoch, cfg,
                                             snapshot_at)
        if run.step % cfg.log_every == 0:
            run.record()
        if bar is not None:
            bar.update(1)
            if run.step % 10 == 0:
                bar.set_postfix(loss=f"{run.loss:.4f}", acc=f"{run.acc:.4f}", refresh=False)
        if save is not None and time.perf_counter() - last_ckpt > cfg.checkpoint_every_s:
            save()
            last_ckpt = time.perf_counter()
        if callback is not None and callback(run.step, run.loss, run.acc):
            break


def _minibatch(data: SeqData, step: int, steps_per_epoch: int, bs: int, perm, cfg: TrainConfig) -> tuple:
    """The rows of ``step``'s minibatch: (input_ids [bs, L], targets [bs, T], the epoch's order ``perm`` [n],
    drawn afresh at each epoch's start from a generator seeded by (``cfg.seed``, epoch))."""
    pos = step % steps_per_epoch
    if perm is None or pos == 0:
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step // steps_per_epoch)
        perm = torch.randperm(len(data), generator=g).to(data.input_ids.device)
    idx = perm[pos * bs:(pos + 1) * bs]
    return data.input_ids[idx], data.targets[idx], perm


def _fits_before_update(run: _RunState, model, data: SeqData, acc: float, cfg: TrainConfig, snapshot_at) -> bool:
    """Full batch: ``acc`` of the current parameters (before the update), confirmed by a plain argmax pass when it
    reaches the target; True (``run.done``) when the stopping rule is met at this step."""
    run.acc = acc
    if run.fit_step is None and run.acc >= cfg.target_acc:
        run.acc = evaluate(model, data)        # confirm with a plain argmax pass
        if run.acc >= cfg.target_acc:
            run.fit_now()
    if run.fit_step is not None:
        run.keep_snapshot(model, snapshot_at)
        if stop_now(run.step - run.fit_step, cfg):
            run.done = True
            return True
    return False


def _after_minibatch(run: _RunState, model, data: SeqData, correct_epoch: int, steps_per_epoch: int, cfg: TrainConfig,
                     snapshot_at) -> int:
    """Minibatch mode, after an update: at an epoch's end the accuracy (the epoch's running count, confirmed by a
    full pass near the target), the fit, snapshots and the stopping rule; returns the epoch's count so far."""
    if run.step % steps_per_epoch == 0:
        running = correct_epoch / data.n_predictions
        correct_epoch = 0
        # the running accuracy is stale (parameters moved during the epoch): confirm with a full pass
        run.acc = evaluate(model, data) if running >= cfg.target_acc - 0.01 else running
        if run.fit_step is None and run.acc >= cfg.target_acc:
            run.fit_now()
    if run.fit_step is not None:
        run.keep_snapshot(model, snapshot_at)
        run.done = stop_now(run.step - run.fit_step, cfg)
    return correct_epoch


def _conclude(run: _RunState, model, data: SeqData, cfg: TrainConfig, snapshot_at) -> None:
    """After the loop: the accuracy of the final parameters (unless it stopped at its confirmed fit), a fit
    reached with the last update, and the last history row."""
    if not run.done or cfg.past_fit is not None:
        run.acc = evaluate(model, data)      # the parameters it ends with
    if run.fit_step is None and run.acc >= cfg.target_acc:
        run.fit_now()                        # reached with the last update
        if 0 in snapshot_at:
            run.snapshots[0] = snapshot(model)
    if not run.history or run.history[-1][0] != run.step:
        run.record()


def stop_now(past: int, cfg: TrainConfig) -> bool:
    """The stopping rule, ``past`` steps after the first step at ``target_acc``."""
    return cfg.past_fit is None or past >= cfg.past_fit


SNAPSHOT = ("subject_embed", "unembed_weight")      # what a snapshot keeps: what the readouts read


def snapshot(model: FactRecallModel) -> dict[str, torch.Tensor]:
    """Copies of the subject embeddings [N, d] and the unembedding [n_outputs, d] (on the CPU)."""
    return {name: getattr(model, name).detach().cpu().clone() for name in SNAPSHOT}


def run_result(task, model: FactRecallModel, cfg: TrainConfig, *, steps: int, accuracy: float, loss: float,
               history: list, wall_s: float, cpu_s: float, time_to_target_s: float | None, facts_per_step: int,
               fit_step: int | None, batch_models: int = 1) -> RunResult:
    """The :class:`RunResult` of ``model`` trained on ``task`` (the trained model at ``result.model``), from what
    the training loop counted (this trainer's or :func:`synthetic.batched.train_batched`'s). ``success``: some
    step reached ``target_acc`` (``fit_step``); ``accuracy`` is that of the final parameters."""
    mcfg = model.config
    n = model.n_params()
    bits = task.bits()
    result = RunResult(
        accuracy=accuracy, success=fit_step is not None, steps=steps, wall_time_s=round(wall_s, 3),
        n_params=n["total"], n_trainable=n["trainable"], bits=round(bits, 1),
        bits_per_param=float(f"{bits / max(1, n['trainable']):.4g}"), loss=loss,
        facts_per_s=round(steps * facts_per_step / max(wall_s, 1e-9), 1), n_subjects=mcfg.n_subjects,
        n_relations=mcfg.n_relations, d_model=mcfg.d_model, d_mlp=mcfg.d_mlp, frozen_subjects=mcfg.frozen_subjects,
        attention=mcfg.attention, task_kind=task.kind, train=cfg.to_dict(), history=list(history),
        time_to_target_s=None if time_to_target_s is None else round(time_to_target_s, 3),
        cpu_time_s=round(cpu_s, 3), batch_models=batch_models, fit_step=fit_step)
    result.model = model
    return result


def save_run(out_dir: str, result: RunResult, moments: dict, elapsed: float, cfg: TrainConfig) -> None:
    """The finished run in ``out_dir``: its checkpoint (parameters, Adam ``moments``, state after ``elapsed``
    seconds) and ``run.json``."""
    _save_checkpoint(out_dir, result.model, moments, result.steps, elapsed, result.history, result.accuracy,
                     result.loss, cfg, result.fit_step)
    write_json(os.path.join(out_dir, RUN), {**result.to_dict(), "model_config": result.model.config.to_dict()})


def load_run(out_dir: str, device: str = "cpu") -> tuple[FactRecallModel, FactTask | KHopTask, dict]:
    """Load a trained model, its task and its ``run.json`` (or checkpoint state) from a training directory."""
    state = _read_state(out_dir)
    model = FactRecallModel(ModelConfig.from_dict(state["model_config"]))
    path = os.path.join(out_dir, CHECKPOINT)
    _copy_parameters(model, _load_tensors(path, device=device), path)
    task = _load_task(out_dir)
    run_path = os.path.join(out_dir, RUN)
    info = state
    if os.path.exists(run_path):
        info = check_fields(read_json(run_path), run_path, {"train": (dict, None)})
        check_fields(info.get("train") or {}, f"{run_path}: train", TrainConfig)
    return model.to(device), task, info


# ----------------------------------------------------------------------------- persistence
def _progress(cfg: TrainConfig, start: int):
    if not cfg.progress:
        return None
    return console.bar(total=cfg.max_steps, initial=start, desc="train", unit="step", leave=False, mininterval=0.5)


def _save_task(task, out_dir: str) -> None:
    if isinstance(task, KHopTask):
        obj = {"khop": {"hops": task.hops, "cot": task.cot, "sequences": task.sequences.tolist()},
               "base": task.base.to_json()}
    else:
        obj = task.to_json()
    write_json(os.path.join(out_dir, TASK), obj)


def _load_task(out_dir: str):
    """The task in ``out_dir/task.json``, its types checked (UsageError naming the file and the field)."""
    path = os.path.join(out_dir, TASK)
    obj = read_json(path)
    if isinstance(obj, dict) and "khop" in obj:
        check_fields(obj, path, {"khop": dict, "base": dict}, required=("base",))
        k = check_fields(obj["khop"], f"{path}: khop", {"hops": int, "cot": bool, "sequences": list},
                         required=("hops", "cot", "sequences"))
        return KHopTask(FactTask.from_json(obj["base"], f"{path}: base"), k["hops"], k["cot"],
                        id_tensor(k["sequences"], f"{path}: khop", "sequences", 2))
    return FactTask.from_json(obj, path)


# the types of a checkpoint's training state (_save_checkpoint); None: null allowed
STATE_FIELDS = {"step": int, "elapsed": float, "history": list, "accuracy": (float, None), "loss": (float, None),
                "fit_step": (int, None), "opt_step": (dict, None), "train_config": (dict, None), "model_config": dict}


def _check_state(state, source: str) -> dict:
    """``state`` when its fields (and those of its configs) have their types, else UsageError naming ``source``."""
    check_fields(state, source, STATE_FIELDS, required=("step", "elapsed", "history", "model_config"))
    check_fields(state["model_config"], f"{source}: model_config", ModelConfig)
    check_fields(state.get("train_config") or {}, f"{source}: train_config", TrainConfig)
    check_fields(state.get("opt_step") or {}, f"{source}: opt_step", {"*": float})
    return state


def _checkpoint_state(out_dir) -> dict | None:
    """The training state stored in the metadata of ``checkpoint.safetensors``, its types checked (None: no file,
    or an older checkpoint without it)."""
    path = os.path.join(out_dir, CHECKPOINT)
    if not os.path.exists(path):
        return None
    try:
        with safe_open(path, framework="pt") as handle:
            meta = handle.metadata() or {}
    except SafetensorError as error:
        raise _not_safetensors(path, error) from None
    if "llmprobe_state" not in meta:
        return None
    source = f"{path} (metadata llmprobe_state)"
    return _check_state(parse_json(meta["llmprobe_state"], source), source)


def _not_safetensors(path, error) -> UsageError:
    return UsageError(f"not a readable safetensors checkpoint: {path} ({error})")


def _load_tensors(path: str, device: str = "cpu") -> dict:
    """The tensors of checkpoint ``path``; UsageError naming it when safetensors cannot read it (corrupt, cut)."""
    try:
        return load_file(path, device=device)
    except SafetensorError as error:
        raise _not_safetensors(path, error) from None


def _copy_parameters(model: FactRecallModel, tensors: dict, path: str) -> None:
    """Copy checkpoint ``tensors`` into ``model``'s parameters; UsageError naming ``path`` and every parameter
    that is missing from it or has another shape than the model its ``model_config`` describes (a checkpoint whose
    config was edited, or tensors of another model)."""
    params = dict(model.named_parameters())
    missing = [name for name in params if name not in tensors]
    wrong = [f"{name} {tuple(tensors[name].shape)} (the config gives {tuple(p.shape)})"
             for name, p in params.items() if name in tensors and tensors[name].shape != p.shape]
    if missing or wrong:
        raise UsageError(f"{path} does not hold the model its model_config describes: "
                         + "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else "",
                                                  f"shapes {', '.join(wrong)}" if wrong else ""])))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name].to(p.device))


def _read_state(out_dir) -> dict:
    """The checkpoint's training state: its safetensors metadata, else (an older checkpoint) checkpoint.json."""
    state = _checkpoint_state(out_dir)
    if state is None:
        path = os.path.join(out_dir, STATE)
        state = _check_state(read_json(path), path)
    return state


def adam_moments(opt, params: dict) -> dict:
    """{name: (exp_avg, exp_avg_sq, step)} of a torch Adam over ``params`` (names without state are left out)."""
    out = {}
    for name, p in params.items():
        st = opt.state.get(p, {})
        if "exp_avg" in st:
            out[name] = (st["exp_avg"], st["exp_avg_sq"], float(st["step"]))
    return out


def _save_checkpoint(out_dir, model, moments: dict, step, elapsed, history, acc, loss, cfg,
                     fit_step: int | None = None) -> None:
    """Parameters, Adam ``moments`` ({name: (exp_avg, exp_avg_sq, step)}) and the training state, atomically."""
    tensors = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters()}
    opt_step = {}
    for name, (exp_avg, exp_avg_sq, opt_steps) in moments.items():
        tensors[f"opt.{name}.exp_avg"] = exp_avg.detach().cpu().contiguous()
        tensors[f"opt.{name}.exp_avg_sq"] = exp_avg_sq.detach().cpu().contiguous()
        opt_step[name] = float(opt_steps)
    state = {"step": step, "elapsed": elapsed, "history": history, "accuracy": acc, "loss": loss,
             "fit_step": fit_step, "opt_step": opt_step, "train_config": cfg.to_dict(), "model_config": model.config.to_dict()}
    # one file, one atomic write: the state travels with the tensors it describes
    write_bytes(os.path.join(out_dir, CHECKPOINT),
                save(tensors, metadata={"llmprobe_state": json.dumps(state)}))
    write_json(os.path.join(out_dir, STATE), state)


def read_checkpoint(out_dir, model) -> tuple[dict, dict]:
    """Load a checkpoint's parameters into ``model`` (same config, else ValueError); returns (state, moments
    {name: (exp_avg, exp_avg_sq, step)} on the model's device)."""
    state = _read_state(out_dir)
    saved = ModelConfig.from_dict(state["model_config"]).to_dict()
    if saved != model.config.to_dict():
        raise ValueError(f"{out_dir} holds a checkpoint of a different model ({saved}); use another directory "
                         f"or resume=False")
    path = os.path.join(out_dir, CHECKPOINT)
    tensors = _load_tensors(path)
    device = next(model.parameters()).device
    _copy_parameters(model, tensors, path)
    moments = {name: (tensors[f"opt.{name}.exp_avg"].to(device), tensors[f"opt.{name}.exp_avg_sq"].to(device),
                      state["opt_step"][name])
               for name, _ in model.named_parameters() if f"opt.{name}.exp_avg" in tensors}
    return state, moments


def _load_checkpoint(out_dir, model, opt, params) -> dict:
    state, moments = read_checkpoint(out_dir, model)
    for name, p in params.items():
        if name in moments:
            exp_avg, exp_avg_sq, steps = moments[name]
            opt.state[p] = {"step": torch.tensor(steps), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return state
