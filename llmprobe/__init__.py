"""llmprobe: measure how language models store facts.

Python API (mirrors the CLI)::

    from llmprobe import load_model, load_relations, capture, encode, probe
    lm = load_model()                                   # embedded SmolLM2-135M-Instruct, or a hub name / folder
    batch = encode(lm.tokenizer, "The capital of {} is", ["France", "Japan"])
    states = capture(lm.model, ["blocks.12.resid_post"], batch.input_ids, batch.attention_mask,
                     positions=batch.subject_last[:, None])          # {name: [batch, 1, d_model]}
    states = capture(lm, ["blocks.12.resid_post"], "The capital of France is")   # {name: [1, seq, d_model]}
    report = probe(lm=lm, relations=["country_capital"], out="runs/mine", progress=False)   # a dict, as report.json

    # a decoder by hand: the states and Jacobians of a relation's prompts, the LRE fitted on them
    from llmprobe import LinearRelationDecoder, relation_states, subject_jacobians
    subjects = ["France", "Japan", "Brazil"]
    states = relation_states(lm, "The capital of {} is", subjects, layers=[6])   # .H[6] [n, d], .O [n, d]
    jac = subject_jacobians(lm, "The capital of {} is", subjects, 6)           # .H, .O [n, d], .J [n, d, d]
    lre = LinearRelationDecoder(beta=2.0).fit(jac.H, jac.O, jac.J)            # .operator_: o = beta W h + b

Names are imported lazily, so ``import llmprobe.geometry`` loads only the geometry math and
``import llmprobe.settings`` no torch. No module of the package shares a public name: ``llmprobe.capture``,
``llmprobe.probe`` and ``llmprobe.run`` are always the functions.
"""
import importlib

__version__ = "0.1.0"
_EXPORTS = {         # public name -> the module that defines it (imported on first use)
    "capture": "model.capture", "forward": "model.capture", "patch": "model.capture",
    "DatasetError": "datasets", "Fact": "datasets", "FactTable": "datasets", "Relation": "datasets",
    "load_relations": "datasets", "ModelLoadError": "model.loading", "load_model": "model.loading",
    "probe": "jobs.probe", "run": "jobs.main",
    "SubjectNotFoundError": "model.subjects", "encode": "model.subjects",
    "as_loaded_model": "model.interop", "to_lens_name": "model.adapters", "from_lens_name": "model.adapters",
    "load_report": "report.notebook", "Report": "report.notebook", "load_decoder": "analyses.saved",
    "SavedDecoder": "analyses.saved", "list_bundled": "datasets",
    # the decoders' building blocks: the states and Jacobians of a relation's prompts, the estimators and operator
    "relation_states": "model.engine", "subject_jacobians": "model.lre",
    "LinearRelationOperator": "geometry.decoders", "LinearRelationDecoder": "geometry.decoders",
    "RidgeDecoder": "geometry.decoders",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'llmprobe' has no attribute {name!r}")
