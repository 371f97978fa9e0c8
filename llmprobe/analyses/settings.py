"""Settings of the analyses, the places they read, and small shared helpers (no model code)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from tqdm.auto import tqdm

from llmprobe import console
from llmprobe.names import FIRST_TOKEN, LRE_SELECTIONS, PROTOCOLS, SCORING_MODES

O_PLACE = ("o = output of the last block (blocks.{L-1}.resid_post, before the final norm) at the prompt's last "
           "token; logits = adapter.logits(o) = final norm + LM head")
H_PLACE = "h = blocks.{l}.resid_post at the subject's last token"
FIRST_TOKEN_NOTE = "objects scored by their first token (the first token of ' ' + object after the prompt)"
PREFIX_NOTE = ("a prediction counts when the decoded top-1 token, stripped and lower-cased, is a non-empty prefix "
               "of the object (the LRE reference's rule)")


class AnalysisError(ValueError):
    """An analysis could not run on one relation (the message names it); the others go on."""


@dataclass
class AnalysisSettings:
    """Options of ``run_analyses`` (all recorded in the result's ``settings``); ``docs/measures.md`` defines
    every measure they shape."""

    n_splits: int = 3                 # re-fits: re-drawn train/validation and Jacobian subjects (test stays fixed)
    seed: int = 0
    max_subjects: int = 90            # known facts used per relation (the first ones: most populous countries)
    min_known: int = 8                # fewer known facts -> the relation's decoders are skipped with an error
    n_jacobian: int = 3               # prompts whose Jacobians are averaged into W (re-drawn per re-fit)
    test_fraction: float = 1 / 3      # of the relation's known facts: the fixed held-out test set
    val_fraction: float = 1 / 4       # of the remaining subjects, per re-fit
    selection_folds: int = 5          # K-fold cross-validation of the LRE's (beta, rank) over train + validation
    betas: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
    ranks: tuple[int | None, ...] = (None, 128, 32)   # truncation of W for faithfulness (None = full)
    edit_ranks: tuple[int, ...] = (8, 32, 128)        # rank of the pseudo-inverse used by causality edits
    max_val_pairs: int = 8                      # causality edits per re-fit used to choose the edit rank
    max_test_pairs: int = 30                    # causality edits on the fixed test subjects (drawn once)
    ridge_alphas: tuple[float, ...] = tuple(10.0 ** k for k in range(-2, 6))
    protocol: str = "strict"          # "strict" (exact first token) or "lre" (the LRE reference's pipeline)
    n_icl: int | None = None          # in-context examples before every prompt (known-fact filter and analyses);
                                      # none = the protocol's: strict 0 (zero-shot), lre 5 (the reference's N)
    lre_selection: str = "validation"  # protocol lre: beta, edit rank, layer chosen on "validation" facts or, as
                                       # the reference did, on the test facts ("as-published", labelled so)
    lre_betas: tuple[float, ...] = tuple(i / 4 for i in range(21))      # protocol lre: the reference's 0 .. 5 (its
    # GPT-J grid; left at this default, a Llama-class model gets the reference's LLaMA grid 0 .. 10: decoders.lre_grids)
    lre_edit_ranks: tuple[int, ...] = tuple(range(0, 320, 8))          # protocol lre: the reference's 0 .. 312
    # (Llama-class default: 0 .. 504, decoders.lre_grids)
    scoring: str = FIRST_TOKEN        # causality success: first token, or "sequence" (full-sequence log-prob)
    lre_layers: tuple[int, ...] | None = None   # None: up to max_lre_layers of the layers (Jacobians cost the most)
    max_lre_layers: int = 3
    causality_layers: tuple[int, ...] | None = None   # None: the LRE layers
    superposition_facts: str = "all"  # "all" facts of the shared-subject table, or "known" ones only
    neutral_templates: tuple[str, ...] | None = None  # None: the relations' own, minus those that open with
                                                      # the subject when the tokenizer adds no leading special token
    attribute_vectors: str = "first"  # "first" token's unembedding row, or "mean" over the attribute's tokens
    max_superposition_subjects: int | None = None
    folds: int = 5                    # cross-fitting folds of the superposition readouts
    random_control: bool = True       # the random-init model of the same architecture
    swap_layers: tuple[int, ...] | None = None  # None: the LRE layers
    max_swap_subjects: int = 12
    swap_scales: tuple[float, ...] = (1.0, 4.0, 16.0)  # swap edits also at these multiples of the fitted edit
                                                       # (dose-response)
    n_boot: int = 1000
    jackknife_groups: int = 20        # refits behind each superposition interval (grouped jackknife; 0 = the old
                                      # bootstrap of out-of-fold values, which under-covers: benchmarks/coverage.py)
    batch_size: int = 32
    jacobian_batch_size: int = 16
    jacobian_chunk: int = 48           # output dims per batched backward (48: 6-10% faster than 96 on SmolLM2, same J)
    jacobian_rank: int | str = "auto"  # "full": exact; K: low-rank estimate of rank K; "auto": jacobian_rank_for
    jacobian_oversample: int = 10      # extra columns of the low-rank estimator (k = K + this)


def pick_layers(layers: list[int], k: int, n_layers: int) -> list[int]:
    """Up to ``k`` of ``layers`` spread through depth (at the fractions 1/(k+1) ... k/(k+1) of the list),
    leaving out the last layer (where an edit at the subject cannot reach the last token)."""
    candidates = [l for l in sorted(layers) if l != n_layers - 1] or sorted(layers)
    if len(candidates) <= k:
        return candidates
    picks = {candidates[min(len(candidates) - 1, round((i + 1) * len(candidates) / (k + 1)))] for i in range(k)}
    return sorted(picks)


def layers_among(spec, layers: list[int], n_layers: int) -> list[int]:
    """The layers of ``spec`` (whole numbers, negative from the end) that are among ``layers``, sorted; ValueError
    for one outside an ``n_layers``-deep model."""
    resolved = set()
    for layer in spec:
        index = int(layer) + (n_layers if int(layer) < 0 else 0)
        if not 0 <= index < n_layers:
            raise ValueError(f"layer {layer} out of range: the model has {n_layers} layers")
        resolved.add(index)
    return sorted(resolved & set(layers))


def planned_lre_layers(cfg: AnalysisSettings, layers: list[int], n_layers: int) -> list[int]:
    """The LRE layers a run takes among ``layers`` of an ``n_layers``-deep model: ``cfg.lre_layers`` there, else
    ``pick_layers``. From the depth alone, so the plan and the run take the same."""
    if cfg.lre_layers is not None:
        return layers_among(cfg.lre_layers, layers, n_layers)
    return pick_layers(layers, cfg.max_lre_layers, n_layers)


def settings_from(n_splits: int = 3, seed: int = 0, max_subjects: int = 90, **options) -> AnalysisSettings:
    """Validated settings: unknown option names and values outside their choices raise at once."""
    bad = [k for k in options if k not in AnalysisSettings.__dataclass_fields__]
    if bad:
        raise TypeError(f"unknown options {bad}; see AnalysisSettings")
    cfg = AnalysisSettings(n_splits=n_splits, seed=seed, max_subjects=max_subjects, **options)
    if cfg.scoring not in SCORING_MODES:
        raise ValueError(f"scoring must be one of {SCORING_MODES}, got {cfg.scoring!r}")
    if cfg.protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {cfg.protocol!r}")
    if cfg.lre_selection not in LRE_SELECTIONS:
        raise ValueError(f"lre_selection must be one of {LRE_SELECTIONS}, got {cfg.lre_selection!r}")
    if cfg.n_splits < 1:
        raise ValueError("n_splits must be >= 1")
    rank = cfg.jacobian_rank
    if not (rank in ("auto", "full") or (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1)):
        raise ValueError(f"jacobian_rank must be a positive integer, 'auto' or 'full' (exact), got {rank!r}")
    return cfg


class Log:
    """Progress on stderr: a tqdm bar per stage (:meth:`bar`: "analyses ... 3/17 [05:12, ~10:24 left]") and lines
    with the seconds since the analyses started and, inside a stage, its item "k/N" and the time left:
    ``[analyses 743s | 3/17, ~10:24 left] country_continent: ...``. The time left comes from the items
    computed (not those :meth:`skip` marks): with the plan's seconds per item (``bar(planned=...)``, from
    ``llmprobe.jobs.plan``) it is the items left's planned seconds times measured / planned of the items computed
    (the plan before any was computed, "(planned)"); without it their mean time times the items left
    ("estimating..." until one was computed); divided by ``processes`` when helper processes share the items
    (:meth:`elsewhere`: an item another process computed). While the current item waits for a core the controls'
    workers hold (:meth:`waiting`, until :meth:`started`), the bar and the lines say so and its time left stands
    still. ``write``: where a line goes (default: the ``"llmprobe"`` logger, above the bars on stderr:
    ``llmprobe.console.say``; a helper process sends its lines to the main one). The bars and lines follow the
    process's switch too (``llmprobe.console.showing``: no bar unless stderr is a terminal, by default)."""

    def __init__(self, enabled: bool, write=None):
        self.enabled, self.start, self.write = enabled, time.perf_counter(), write
        self.done, self.total = 0, 0                       # the stage in progress: items done (computed or not) of N
        self.computed, self.seconds = 0, 0.0               # items computed and their time: the rate of the time left
        self.planned: list[float] | None = None            # the plan's seconds per item, or None
        self.planned_computed = 0.0                        # the plan's seconds of the items computed
        self.skipped, self.begun = False, 0.0              # the current item: marked by skip(); its start
        self.processes = 1                                 # processes sharing the items (the time left divides)
        self.held = False                                  # the current item waits for a core (waiting())
        self.live = None                                   # the stage's tqdm bar while it runs

    def bar(self, items: list, what: str, unit: str = "relation", planned: list[float] | None = None) -> Iterator:
        """``items`` one by one under a progress bar named ``what`` (k of N, elapsed and remaining time);
        ``planned``: the plan's seconds of each item (as many as ``items``), or None."""
        if planned is not None and len(planned) != len(items):
            raise ValueError(f"bar: {len(planned)} planned seconds for {len(items)} items")
        self.done, self.total, self.computed, self.seconds = 0, len(items), 0, 0.0
        self.planned, self.planned_computed = (list(planned) if planned is not None else None), 0.0
        self.begun = time.perf_counter()
        style = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"    # postfix: ", ~10:24 left"
        try:
            with console.bar(total=len(items), enabled=self.enabled, desc=what, unit=unit, bar_format=style,
                     postfix=self.left() or "estimating...") as live:
                self.live = live
                for item in items:
                    self.skipped, self.begun = False, time.perf_counter()
                    yield item
                    if not self.skipped:
                        self.computed += 1
                        self.seconds += time.perf_counter() - self.begun
                        self.planned_computed += self.planned[self.done] if self.planned else 0.0
                    self.done, self.begun = self.done + 1, time.perf_counter()
                    live.set_postfix_str(self.left() or "done", refresh=False)
                    live.update()
        finally:
            self.total, self.planned, self.live, self.held = 0, None, None, False

    def elsewhere(self, seconds: float) -> None:
        """The bar's current item was computed by another process in ``seconds``: it counts in the rate with
        those seconds, not with the time this process waited for it."""
        self.skipped = True
        if self.total and self.done < self.total:
            self.computed += 1
            self.seconds += seconds
            self.planned_computed += self.planned[self.done] if self.planned else 0.0

    def waiting(self) -> None:
        """The bar's current item waits for a core (``Parts``' gate): the bar says so until :meth:`started`."""
        self.held = True
        self._show()

    def started(self) -> None:
        """The bar's current item starts being computed now: the time it waited for a core (``Parts``' gate)
        stays out of its seconds."""
        self.held, self.begun = False, time.perf_counter()
        self._show()

    def _show(self) -> None:
        """Redraw the bar's time left (tqdm redraws it only when an item is done)."""
        if self.live is not None:
            self.live.set_postfix_str(self.left() or "estimating...")

    def skip(self) -> None:
        """The bar's current item is not computed (taken over from an earlier result, or refused at once: too few
        facts): it counts as done, but its time (about 0 s) stays out of the rate the time left is estimated from."""
        self.skipped = True

    def left(self) -> str:
        """``~10:24 left`` (measured), ``~10:24 left (planned)`` (the plan alone, nothing computed yet) or ""
        (nothing to estimate from, or the stage is over). The current item's estimate counts down with its
        elapsed time, never below the estimate of the items after it."""
        if self.done >= self.total:
            return ""
        if self.planned is not None and (self.planned_computed > 0 or not self.computed):
            rate = self.seconds / self.planned_computed if self.computed else 1.0
            now, after = self.planned[self.done] * rate, sum(self.planned[self.done + 1:]) * rate
        elif self.computed:
            now = self.seconds / self.computed
            after = now * (self.total - self.done - 1)
        else:
            return ""
        elapsed = 0.0 if self.held else time.perf_counter() - self.begun
        left = (after + max(0.0, now - elapsed)) / self.processes
        return (f"~{tqdm.format_interval(left)} left" + ("" if self.computed else " (planned)")
                + (" once a core is free (the controls hold them)" if self.held else ""))

    def where(self) -> str:
        """`` | 3/17, ~10:24 left`` while a stage runs (:meth:`left`; "estimating..." when there is
        nothing to estimate from yet), else ""."""
        if self.done >= self.total:
            return ""
        return f" | {self.done + 1}/{self.total}, {self.left() or 'estimating...'}"

    def __call__(self, message: str) -> None:
        if self.write is not None:
            self.write(message)
        elif self.enabled:
            console.say(message, prefix=f"[analyses {time.perf_counter() - self.start:6.0f}s{self.where()}]")
