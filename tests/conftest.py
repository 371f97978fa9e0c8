"""Shared test set-up: quiet, few threads (CI has 2 shared cores), offline."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


import dataclasses  # noqa: E402
import functools  # noqa: E402

import pytest  # noqa: E402
from test_analyses import FAST  # noqa: E402

import llmprobe.analyses.run  # noqa: E402
import llmprobe.jobs.probe  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Code under test may set torch's thread count (sweeps, ``--threads``); every test starts from one thread, so
    that a result compared bit for bit with a fresh one-thread process does not depend on the tests before it."""
    yield
    torch.set_num_threads(1)


@pytest.fixture
def fast_known(monkeypatch):
    """In-process probe and run: every fact known (a random model knows nothing) and fast analysis settings."""
    real_known = llmprobe.model.known.known_facts
    monkeypatch.setattr(llmprobe.model.known, "known_facts", lambda lm, relation, **kw: [
        dataclasses.replace(r, known=True) for r in real_known(lm, relation, **kw)])
    monkeypatch.setattr(llmprobe.analyses.run, "run_analyses",
                        functools.partial(llmprobe.analyses.run.run_analyses, progress=False, **FAST))
