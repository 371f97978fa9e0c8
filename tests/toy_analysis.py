"""A toy analysis, written as a user adds one (docs/CONTRACTS.md, "How to add an analysis"): this module and one
``register`` line. It measures, per relation, the fraction of known facts whose next token after the relation's
prompt is the object's first token, pooled over relations, beside the same model with its MLPs' outputs zeroed at
every probed layer as its null, and feeds a claim line of its own (one ``register_line``)."""
from __future__ import annotations

import torch

from llmprobe.analyses.passes import empty_passes, padded_batches
from llmprobe.analyses.record import Analysis
from llmprobe.metric import proportion
from llmprobe.model.capture import hooks
from llmprobe.model.engine import next_token_predictions
from llmprobe.model.scoring import first_token_targets
from llmprobe.report.claims import ClaimLine, claim_test


def known_items(relations, known: dict) -> list[tuple[str, str, str]]:
    """(template, subject, object) of every known fact, relation by relation."""
    return [(r.templates[0], f.subject, f.object) for r in relations for f in known.get(r.name, ()) if f.known]


def compute(job) -> dict:
    """Its entry: ``agreement`` (a proportion over the known facts) with the MLP-ablated model as its null."""
    items = known_items(job.relations, job.known)
    if not items:
        raise ValueError("no known fact")
    templates, subjects = [t for t, _, _ in items], [s for _, s, _ in items]
    prompts = [t.replace("{}", s, 1) for t, s in zip(templates, subjects)]
    targets = first_token_targets(job.lm.tokenizer, prompts, [o for _, _, o in items])
    clean = next_token_predictions(job.lm, templates, subjects, batch_size=job.cfg.batch_size)
    with hooks(job.lm.adapter, {f"blocks.{l}.mlp_out": torch.zeros_like for l in job.layers}):
        ablated = next_token_predictions(job.lm, templates, subjects, batch_size=job.cfg.batch_size)
    agreement = proportion((clean == targets).tolist()).with_nulls({"mlp_zeroed": proportion(
        (ablated == targets).tolist())})
    return {"agreement": agreement.to_dict(), "n_facts": len(items)}


def workload(tok, relations, known, layers, n_layers, cfg, analyses) -> dict:
    """Its passes: the known prompts through every block with the LM head, twice (clean, ablated)."""
    work = empty_passes()
    prompts = [t.replace("{}", s, 1) for t, s, _ in known_items(relations, known)]
    work["forward"] += [(padded_batches(tok, prompts, cfg.batch_size), n_layers, True)] * 2
    return work


def claim_tests(report: dict) -> tuple[list[dict], str]:
    """Its claim line's one test: the agreement against the MLP-zeroed model (none when the report has no entry)."""
    agreement = ((report.get("analyses") or {}).get("toy") or {}).get("agreement")
    tests = [claim_test(TOY_CLAIM.claim, "all relations", None, agreement)] if agreement else []
    return tests, "next-token agreement with the object over the known facts, all relations pooled"


TOY_CLAIM = ClaimLine("the MLPs carry the known facts (toy)", claim_tests, nulls=("mlp_zeroed",), min_effect=0.1)
TOY = Analysis("toy", ("toy",), compute, workload, "toy agreement", claims=(TOY_CLAIM.claim,))
