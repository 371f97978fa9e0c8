"""Geometry: pure tensor math for relation decoders and superposition readouts.

Shared by pretrained and synthetic models; imports only torch, numpy and scikit-learn (never model loading, the CLI
or reports). Estimators are scikit-learn shaped: ``fit`` returns self, learned attributes end in ``_``, ``score``
returns one float.
"""
from llmprobe.geometry.decoders import (
                       LinearRelationDecoder,
                       LinearRelationOperator,
                       RidgeDecoder,
                       random_direction_like,
                       random_spectrum_factors,
                       random_spectrum_like,
                       topk_hits,
)
from llmprobe.geometry.readouts import (
                       RelationReadout,
                       SuperpositionFit,
                       SuperpositionReport,
                       merge_equal_attributes,
                       random_attributes,
                       relation_contributions,
                       superposition_readout,
)
from llmprobe.geometry.stats import (
                       ALPHA_GRID,
                       cross_val_score,
                       kfold_indices,
                       pinv_rank,
                       r2_score,
                       ridge_fit,
                       ridge_fit_cv,
                       shuffle_table,
                       train_test_split,
                       truncate_rank,
)

__all__ = [
    "LinearRelationOperator", "LinearRelationDecoder", "RidgeDecoder", "random_direction_like", "random_spectrum_like",
    "random_spectrum_factors",
    "topk_hits",
    "RelationReadout", "SuperpositionFit", "SuperpositionReport", "superposition_readout", "random_attributes",
    "merge_equal_attributes", "relation_contributions",
    "ALPHA_GRID", "cross_val_score", "kfold_indices", "pinv_rank", "r2_score",
    "ridge_fit", "ridge_fit_cv", "shuffle_table", "train_test_split", "truncate_rank",
]
