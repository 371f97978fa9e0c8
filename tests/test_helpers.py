"""Analysis helpers (``llmprobe.jobs.helpers``): parts of ``run_analyses`` computed in another process give the
numbers of one process, and a helper that cannot help leaves every part to the main process."""
import random
import threading
import time

import pytest
import torch
from test_analyses import FAST, _relations
from tiny_models import save_tiny

import llmprobe.jobs.main as main_job
from llmprobe.analyses.run import run_analyses
from llmprobe.analyses.saved import weights_id
from llmprobe.datasets import Fact, Relation
from llmprobe.jobs.helpers import AnalysisHelper
from llmprobe.jobs.matched import CoreGate
from llmprobe.jobs.runner import Parts, SharedRunner
from llmprobe.model.loading import load_model
from llmprobe.settings import Settings


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def work():
    """Relations with every fact known, one with too few known facts (an error entry), and all the analyses."""
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi"]
    rnd = random.Random(1)
    subjects = sorted({"".join(rnd.choice(syllables) for _ in range(3)).capitalize() for _ in range(60)})[:20]
    relations, known = _relations(subjects)
    relations.append(Relation("few", ["The moon of {} is"], ["{}"], [Fact(subjects[0], "Luna")], {}))
    known["few"] = known["capital"][:1]
    return {"relations": relations, "known": known, "layers": [0, 1, 2], "seed": 0, **FAST}


def without_seconds(entry):
    """``entry`` without the seconds things took (keys ``seconds`` and ``*_seconds``)."""
    if isinstance(entry, dict):
        return {k: without_seconds(v) for k, v in entry.items() if k != "seconds" and not k.endswith("_seconds")}
    return [without_seconds(v) for v in entry] if isinstance(entry, list) else entry


def _same(a, b) -> bool:
    """Equal, tensors bit for bit, through dicts and lists."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _analyse(lm, work, helpers=()):
    torch.set_num_threads(1)
    fitted = {}
    result = run_analyses(lm, **work, progress=False, runner=SharedRunner(fitted=fitted, helpers=tuple(helpers)))
    return result, fitted


def _with_helper(lm, work, folder, identity=None):
    """``run_analyses`` with one helper loading ``folder`` (whose weights must be ``identity``, default the main
    process's): (result, fitted, the helper's lines)."""
    lines = []
    helper = AnalysisHelper({"obj": folder, "device": "cpu"}, 0, 1, identity or weights_id(lm.info),
                            on_line=lines.append)
    helper.work("analyses", work)
    try:
        return (*_analyse(lm, work, [helper]), lines)
    finally:
        helper.stop()


def test_parts_computed_by_a_helper_have_the_numbers_of_one_process(folder, work, monkeypatch):
    """Fails when a part's numbers depend on the process (a global RNG, the process's earlier work, another seed:
    checked by giving the helper seed 1) or when the outcomes are merged wrongly (a part missing, twice, another
    relation's entry or decoders, errors out of order). The main process starts once the helper has computed the
    language relation's decoders and every analysis after them (it takes parts from the back), so those numbers
    are the helper's."""
    lm = load_model(folder, device="cpu")
    alone, fitted_alone = _analyse(lm, work)
    claim = Parts.claim

    def claim_after_the_helper(self, part):
        with self.changed:
            self.changed.wait_for(lambda: ("decoders", "language") in self.outcomes or self.lost, timeout=300)
        return claim(self, part)

    monkeypatch.setattr(Parts, "claim", claim_after_the_helper)
    shared, fitted_shared, _ = _with_helper(lm, work, folder)
    assert shared["timing"]["processes"] == 2 and alone["timing"]["processes"] == 1
    by_helper = shared["timing"]["helper_parts"]
    assert {"language", "superposition", "crosspatch", "selector", "multihop"} <= set(by_helper)
    assert "capital" not in by_helper                                                 # it took parts from the back
    for key in ("relations", "superposition", "crosspatch", "selector", "multihop", "errors", "settings"):
        assert _same(without_seconds(shared[key]), without_seconds(alone[key])), key
    assert list(shared["relations"]) == [r.name for r in work["relations"]]
    assert fitted_shared.keys() == fitted_alone.keys() and fitted_alone
    assert _same(fitted_shared, fitted_alone)


@pytest.mark.parametrize("case", ["missing model", "other weights"])
def test_a_helper_that_cannot_help_leaves_every_part_to_the_main_process(folder, work, tmp_path, case):
    """A helper whose model does not load, or loads other weights than the main process's, computes nothing: the
    main process computes every part, says why, and the result is the one-process result."""
    lm = load_model(folder, device="cpu")
    few = {**work, "analyses": ("lre", "superposition")}
    alone, _ = _analyse(lm, few)
    if case == "missing model":
        shared, _, lines = _with_helper(lm, few, str(tmp_path / "nowhere"))
    else:
        shared, _, lines = _with_helper(lm, few, folder, identity="sha256:not-these-weights")
    assert shared["timing"]["helper_parts"] == []
    assert _same(without_seconds(shared["relations"]), without_seconds(alone["relations"]))
    assert _same(without_seconds(shared["superposition"]), without_seconds(alone["superposition"]))
    why = "could not load the model" if case == "missing model" else "loaded other weights"
    assert any(line.startswith("helper stopped: ") and why in line for line in lines), lines


def test_a_helpers_progress_lines_and_errors_come_back_in_run_order(folder, work):
    """The helper takes the last relation (too few known facts): its progress lines reach the main process's
    ``on_line`` and its error is listed in the relations' order, as one process lists it."""
    lm = load_model(folder, device="cpu")
    decoders = {**work, "analyses": ("lre",)}
    shared, _, lines = _with_helper(lm, decoders, folder)
    assert "few" in shared["timing"]["helper_parts"]
    assert "few: decoders (lre)" in lines and any("1 known facts" in line for line in lines), lines
    assert len(shared["errors"]) == 1 and "few" in shared["errors"][0]


def test_a_helper_whose_call_raises_leaves_its_part_to_this_process():
    """A helper that raises (not only one that dies) must not leave its claimed part unanswered: the part is
    marked lost and this process may claim it (without that, this process would wait for it forever)."""
    class Raising:
        def compute(self, part):
            raise RuntimeError("an error no one foresaw")

    parts = Parts([("decoders", "a"), ("decoders", "b")], [Raising()])
    parts.threads[0].join(10)
    assert not parts.threads[0].is_alive() and parts.lost == {("decoders", "b")}
    assert parts.claim(("decoders", "a")) and parts.claim(("decoders", "b"))
    assert parts.wait(("decoders", "b")) is None


class _Worker:
    """A controls worker that is done when the test says so."""
    def __init__(self):
        self.done = threading.Event()

    def ready(self):
        return self.done.is_set()


def test_the_controls_workers_train_first_and_each_core_they_free_goes_to_the_analyses_parts():
    """2 cores, two one-thread workers, one-thread parts (``run`` on 2 cores): no part starts, here or in the
    helper, while both workers train; one at a time once one worker is done; two at once once both are; every
    part's outcome is the one computed, whoever computed it."""
    workers = [_Worker(), _Worker()]
    gate = CoreGate(2, 1, workers)
    gate.POLL_S = 0.01
    assert gate.capacity() == 0
    lock, state = threading.Lock(), {"running": 0, "peak": 0, "started": 0}

    def compute(part):
        with lock:
            state["running"] += 1
            state["started"] += 1
            state["peak"] = max(state["peak"], state["running"])
        give_up = time.monotonic() + 2
        while workers[1].ready() and state["running"] < 2 and time.monotonic() < give_up:
            time.sleep(0.005)           # once both are done, a second part must be let in beside this one
        time.sleep(0.02)
        with lock:
            state["running"] -= 1
        return {"value": {"part": part}, "seconds": 0.0}

    class Helper:
        def compute(self, part):
            return compute(part)

    order = [("decoders", str(i)) for i in range(30)]
    parts = Parts(order, [Helper()], gate)
    outcomes = {}
    main = threading.Thread(target=lambda: outcomes.update({p: parts.outcome(p, compute)[0] for p in order}))
    main.start()
    time.sleep(0.3)
    assert state["started"] == 0, "a part started while both workers held the cores"
    workers[0].done.set()
    assert gate.capacity() == 1
    time.sleep(0.3)
    assert 0 < state["started"] < len(order) and state["peak"] == 1, state
    workers[1].done.set()
    main.join(30)
    assert not main.is_alive() and state["peak"] == 2, state
    assert all(outcomes[p]["value"] == {"part": p} for p in order)
    assert parts.outcomes, "the helper computed nothing"
    assert gate.running == 0 and gate.waited_s >= 0.5        # both processes waited about 0.3 s, then one 0.3 s


def test_the_core_gate_lets_a_part_in_when_no_worker_is_left_however_many_threads_it_needs():
    """A part needing more threads than the cores must not wait forever once the workers are done; 4 cores and two
    2-thread parts beside two alive workers: one part at a time."""
    done, alive = _Worker(), _Worker()
    done.done.set()
    assert CoreGate(2, 4, [done]).capacity() == 1 and CoreGate(2, 4, []).capacity() == 1
    assert CoreGate(4, 2, [_Worker(), alive]).capacity() == 1 and CoreGate(4, 2, [done, done]).capacity() == 2


def test_a_part_that_waited_its_patience_goes_in_one_at_a_time_whatever_the_workers_do():
    """On a busy machine the controls take far longer than planned: a part that has waited ``patience_s`` goes in
    while both workers still hold the cores, but never beside another part; without patience it waits on (the
    default: the workers first)."""
    workers = [_Worker(), _Worker()]
    gate = CoreGate(2, 1, workers, patience_s=0.2)
    gate.POLL_S = 0.01
    inside, peak = [], []

    def part():
        with gate.slot():
            inside.append(1)
            peak.append(len(inside))
            time.sleep(0.3)
            inside.pop()
    threads = [threading.Thread(target=part, daemon=True) for _ in range(3)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(t.is_alive() for t in threads) and max(peak) == 1 and gate.overdue == 3
    assert time.perf_counter() - start >= 0.2 + 3 * 0.3 - 0.05 and not any(w.ready() for w in workers)
    patient = CoreGate(2, 1, [_Worker(), _Worker()])
    patient.POLL_S = 0.01
    entered = threading.Event()

    def wait_in():
        with patient.slot():
            entered.set()
    waiting = threading.Thread(target=wait_in, daemon=True)
    waiting.start()
    assert not entered.wait(0.4) and patient.running == 0        # the default waits for the workers
    patient.workers[0].done.set()
    waiting.join(5)
    assert entered.is_set() and patient.overdue == 0


def test_the_core_gate_says_once_that_a_part_waits_and_not_when_it_goes_in_at_once():
    """``CoreGate.slot(on_wait)``: called once when the part must wait (both workers alive on 2 cores), never when
    a core is free; outside the gate's lock (another thread can take it meanwhile: the callback redraws a bar,
    which takes tqdm's lock)."""
    workers = [_Worker(), _Worker()]
    gate, calls = CoreGate(2, 1, workers), []
    entered = threading.Event()

    def lock_is_free() -> bool:
        got = []

        def take():
            got.append(gate.changed.acquire(timeout=1.0))
            if got[0]:
                gate.changed.release()
        other = threading.Thread(target=take)
        other.start()
        other.join()
        return got[0]

    def waiting():
        calls.append("waiting" if lock_is_free() else "waiting under the gate's lock")

    def part():
        with gate.slot(on_wait=waiting):
            entered.set()

    thread = threading.Thread(target=part)
    thread.start()
    time.sleep(1.2)                                     # more than two polls of the gate
    assert not entered.is_set() and calls == ["waiting"]
    workers[0].done.set()
    thread.join(10)
    assert entered.is_set() and calls == ["waiting"]
    with gate.slot(on_wait=lambda: calls.append("again")):
        pass
    assert calls == ["waiting"]


def test_a_controls_worker_dying_while_the_others_start_stops_them(monkeypatch):
    """The first mode's worker dies before the second is even started (its reader thread reports at once): the
    second is stopped as soon as it is in, not left training until the stage is collected."""
    class Fake:
        made = []

        def __init__(self, args, kwargs, on_progress=None, on_done=None):
            self.mode, self.stopped = kwargs["modes"][0], False
            Fake.made.append(self)
            if self.mode == "trainable":
                on_done(self)                      # died at once

        def failed(self):
            return self.mode == "trainable" or self.stopped

        def stop(self):
            self.stopped = True

    monkeypatch.setattr(main_job, "MatchedWorker", Fake)
    stage = main_job.MatchedStage(Settings(), {})
    stage.start_workers(("table", 8), {}, ("trainable", "frozen"), {})
    first, second = Fake.made
    assert stage.failed is first and not first.stopped and second.stopped
