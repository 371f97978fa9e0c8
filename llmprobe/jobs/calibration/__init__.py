"""Calibration of a claim's measure on planted answers (layer 5: it uses the synthetic models and the analyses): the measure and the verdict rule of
``llmprobe.report.claims`` run on worlds where the claim holds by construction and on worlds where it fails
(``llmprobe.geometry.planted``), at the shapes of a real run, over replicates: **power** (the fraction of
planted positives graded supported) and **false-positive rate** (the fraction of negatives graded supported or
weak). ``benchmarks/calibration.py`` prints the table at the real run's n (docs/measures.md, Calibration);
``tests/test_calibration.py`` runs a quick version that fails when the measure stops separating its worlds.

One module per claim line (``superposition``, ``selector``, ``capacity``, ``swap``, ``width``, ``decodable``,
``causal``, ``crosspatch``, ``cot``) and ``common`` (the parts they share); their public names are re-exported here.
"""
from llmprobe.jobs.calibration.capacity import (
    CapacityWorld,
    calibrate_capacity,
    capacity_worlds,
    format_capacity_rows,
    planted_sweep,
    seed_noise,
    sweep_noise,
)
from llmprobe.jobs.calibration.causal import (
    CAUSAL_BEFORE,
    CausalWorld,
    PlantedRelation,
    calibrate_causal,
    causal_tests,
    causal_worlds,
    equal_rates_causality,
    format_causal_rows,
    linear_relation,
    memory_relation,
    planted_causality,
)
from llmprobe.jobs.calibration.common import (
    finish,
    grade_with_power,
    graded_fractions,
    progress,
    smollm2_table,
    world_row,
)
from llmprobe.jobs.calibration.cot import (
    COT_FAMILY,
    COT_TESTS,
    SMOLLM2_CHAINS,
    SMOLLM2_COT,
    SMOLLM2_DIRECT,
    SMOLLM2_PHI,
    WRONG_BRIDGE_KEYS,
    CotDraw,
    CotWorld,
    calibrate_cot,
    chain_sizes,
    cot_block,
    cot_model_worlds,
    cot_rate_worlds,
    cot_tests,
    format_cot_rows,
    paired_hits,
    planted_chains,
    planted_partners,
    two_hop_hits,
    without_wrong_bridge,
    wrong_bridge_hits,
)
from llmprobe.jobs.calibration.crosspatch import (
    CROSSPATCH_FAMILY,
    CROSSPATCH_TESTS,
    PatchWorld,
    attribute_readout,
    calibrate_crosspatch,
    crosspatch_table,
    crosspatch_tests,
    crosspatch_worlds,
    equal_rates_patches,
    format_crosspatch_rows,
    measure_patch_world,
    median_grade,
    patch_hits,
    planted_patch_items,
)
from llmprobe.jobs.calibration.decodable import (
    DECODABLE_FAMILY,
    LRE_NULLS,
    LRE_SIZES,
    READOUT_NULLS,
    DecodableWorld,
    answers_per_subject,
    calibrate_decodable,
    decodable_states,
    decodable_worlds,
    format_decodable_rows,
    format_testability_rows,
    grade_against,
    lre_faithfulness,
    measure_decodable_world,
    readout_testability,
)
from llmprobe.jobs.calibration.selector import (
    SelectorWorld,
    calibrate_selector,
    format_selector_rows,
    grade_test,
    measure_selector_world,
    redirection,
    selector_worlds,
    transplant_test,
)
from llmprobe.jobs.calibration.superposition import (
    BEFORE,
    WITH_LEXICAL,
    World,
    calibrate,
    format_rows,
    grade,
    measure_world,
    minimal_effect,
    null_gains,
    superposition_worlds,
)
from llmprobe.jobs.calibration.swap import SwapWorld, calibrate_swap, format_swap_rows, swap_worlds, swap_zero_shot
from llmprobe.jobs.calibration.width import GRID, WIDTH_WORLDS, calibrate_width, format_width_rows, planted_dstar

__all__ = [
    "graded_fractions", "world_row", "grade_with_power", "smollm2_table", "progress", "finish", "BEFORE",
    "WITH_LEXICAL", "World", "superposition_worlds", "grade", "measure_world", "calibrate", "null_gains",
    "minimal_effect", "format_rows", "SelectorWorld", "selector_worlds", "grade_test", "measure_selector_world",
    "calibrate_selector", "format_selector_rows", "transplant_test", "redirection", "CapacityWorld",
    "capacity_worlds", "sweep_noise", "seed_noise", "planted_sweep", "calibrate_capacity", "format_capacity_rows",
    "SwapWorld", "swap_zero_shot", "swap_worlds", "calibrate_swap", "format_swap_rows", "GRID", "planted_dstar",
    "WIDTH_WORLDS", "calibrate_width", "format_width_rows", "LRE_SIZES", "READOUT_NULLS", "LRE_NULLS",
    "DECODABLE_FAMILY", "DecodableWorld", "decodable_worlds", "decodable_states", "lre_faithfulness",
    "answers_per_subject", "grade_against", "measure_decodable_world", "calibrate_decodable", "format_decodable_rows",
    "readout_testability", "format_testability_rows", "CAUSAL_BEFORE", "PlantedRelation", "CausalWorld",
    "linear_relation", "memory_relation", "equal_rates_causality", "causal_worlds", "planted_causality",
    "causal_tests", "calibrate_causal", "format_causal_rows", "CROSSPATCH_FAMILY", "CROSSPATCH_TESTS", "PatchWorld",
    "planted_patch_items", "attribute_readout", "patch_hits", "equal_rates_patches", "crosspatch_worlds",
    "crosspatch_tests", "median_grade", "measure_patch_world", "calibrate_crosspatch", "format_crosspatch_rows",
    "crosspatch_table", "COT_FAMILY", "SMOLLM2_CHAINS", "SMOLLM2_DIRECT", "SMOLLM2_COT", "SMOLLM2_PHI", "COT_TESTS",
    "WRONG_BRIDGE_KEYS", "chain_sizes", "CotDraw", "CotWorld", "planted_chains", "wrong_bridge_hits",
    "planted_partners", "paired_hits", "cot_rate_worlds", "two_hop_hits", "cot_model_worlds", "cot_block",
    "without_wrong_bridge", "cot_tests", "calibrate_cot", "format_cot_rows",
]
