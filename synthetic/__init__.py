"""Synthetic factual recall: the controlled world of "Geometric Factual Recall in Transformers".

Tasks (:mod:`synthetic.tasks`), the one-layer model (:mod:`synthetic.model`), training to 100% train accuracy
(:mod:`synthetic.train`), capacity sweeps with bisection on d (:mod:`synthetic.sweep`), the paper's explicit
construction (:mod:`synthetic.construction`) and counting bounds (:mod:`synthetic.bounds`); the figures of every
experiment are drawn by :mod:`synthetic.render`, and every ``llmprobe synth`` subcommand is parsed in
:mod:`synthetic.cli`::

    from synthetic import random_bijections, train, TrainConfig
    task = random_bijections(512, 4, seed=0)
    result = train(task, d_model=12)            # RunResult: accuracy, steps, bits_per_param, ... ; result.model
"""
from synthetic import bounds
from synthetic.construction import build_construction, smallest_construction
from synthetic.model import HOOK_NAMES, FactRecallModel, ModelConfig, softmax_cross_entropy
from synthetic.sweep import SweepConfig, run_sweep, summarize
from synthetic.tasks import (
                    FactTask,
                    KHopTask,
                    SeqData,
                    from_fact_table,
                    from_relations,
                    load_facts,
                    random_bijections,
                    random_functions,
                    random_khop,
)
from synthetic.train import RunResult, TrainConfig, evaluate, load_run, model_config_for, train

__all__ = [
    "HOOK_NAMES", "FactRecallModel", "ModelConfig", "softmax_cross_entropy",
    "FactTask", "KHopTask", "SeqData", "from_fact_table", "from_relations", "load_facts", "random_bijections",
    "random_functions", "random_khop",
    "RunResult", "TrainConfig", "evaluate", "load_run", "model_config_for", "train",
    "SweepConfig", "run_sweep", "summarize", "build_construction", "smallest_construction", "bounds",
]
