"""llmprobe: measure how language models store facts.

Python API (mirrors the CLI)::

    from llmprobe import load_model, load_relations, capture, encode, probe
    lm = load_model()                                   # embedded SmolLM2-135M-Instruct, or a hub name / folder
    batch = encode(lm.tokenizer, "The capital of {} is", ["France", "Japan"])
    states = capture(lm.model, ["blocks.12.resid_post"], batch.input_ids, batch.attention_mask,
                     positions=batch.subject_last[:, None])          # {name: [batch, 1, d_model]}

Names are imported lazily, so ``import llmprobe.geometry`` loads only the geometry math.
"""
import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "capture": "capture", "forward": "capture", "patch": "capture",
    "DatasetError": "datasets", "Fact": "datasets", "FactTable": "datasets", "Relation": "datasets",
    "load_relations": "datasets", "ModelLoadError": "loading", "load_model": "loading", "probe": "probe",
    "run": "run",
    "SubjectNotFoundError": "subjects", "encode": "subjects",
    "as_loaded_model": "interop", "to_lens_name": "adapters", "from_lens_name": "adapters",
    "load_report": "notebook", "load_decoder": "notebook", "Report": "notebook",
}
__all__ = [*_EXPORTS, "__version__"]


def callable_module(module_name: str, function) -> None:
    """Make module ``module_name`` call ``function``: importing a submodule binds its name in this package to the
    module, so ``llmprobe.probe(...)`` and ``llmprobe.run(...)`` must work whether the name holds the function
    or its module."""
    import sys
    import types

    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return function(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'llmprobe' has no attribute {name!r}")
