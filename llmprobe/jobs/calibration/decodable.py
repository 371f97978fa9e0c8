"""The decodable line (:func:`calibrate_decodable`, :func:`readout_testability`) calibrated on planted codes.
Part of the calibration on planted answers (:mod:`llmprobe.jobs.calibration`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmprobe.geometry import merge_equal_attributes, superposition_readout
from llmprobe.geometry.planted import planted_superposition
from llmprobe.jobs.calibration.common import graded_fractions
from llmprobe.metric import proportion
from llmprobe.report.claims import (
    ALPHA,
    DECODABLE,
    DECODABLE_LRE_NULLS,
    GRADES,
    MIN_EFFECT,
    NOT_TESTABLE,
    READOUT_MAX_ANSWERS_PER_SUBJECT,
    difference,
    p_above,
)

# ------------------------------------------------------------------------------------------------ decodable
# The default SmolLM2-135M-Instruct run's LRE sizes (known facts used, test subjects) of the superposition table's
# relations (strict protocol, seed 0; docs/runs.md): the n each relation's LRE faithfulness is measured at.
LRE_SIZES = {"country_capital": (49, 16), "country_continent": (90, 30), "country_currency": (25, 8),
             "country_demonym": (19, 6), "country_language": (79, 26), "country_subregion": (16, 5)}
READOUT_NULLS = ("shuffled", "lexical")   # the readout's nulls a planted world has (no model: no random_init)
LRE_NULLS = DECODABLE_LRE_NULLS          # the report's LRE faithfulness test's nulls
DECODABLE_FAMILY = 28     # the SmolLM2 report's Holm family with the LRE tests (10) and 4 testable readouts


@dataclass(frozen=True)
class DecodableWorld:
    """A world of the decodable line: ``kind`` "planted" (the state carries a linear code of every relation's
    attribute vectors on top of the subject's tokens), "shuffled" (the code of a shuffled table), "lexical" (the
    tokens carry the code and no block adds anything: the state after block 0 is the state) or "tokens" (the
    subjects' static token embeddings, nothing planted); ``holds``: whether the claim holds in it."""

    name: str
    kind: str
    snr: float
    holds: bool


def decodable_worlds(snr: float) -> list[DecodableWorld]:
    """The decodable line's worlds at signal-to-noise ``snr``."""
    return [DecodableWorld(f"planted linear code, snr {snr:g}", "planted", snr, True),
            DecodableWorld(f"shuffled table, snr {snr:g}", "shuffled", snr, False),
            DecodableWorld(f"lexical: the tokens carry the code, snr {snr:g}", "lexical", snr, False),
            DecodableWorld("token embeddings only", "tokens", snr, False)]


def decodable_states(world: DecodableWorld, A: torch.Tensor, U: list, E: torch.Tensor, seed: int
                     ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(H [n, d] the subject states at the decoders' layer, H0 [n, d] their tokens' component (the state after
    block 0, and the readout's lexical states), maps M_r [d, d_u]): the code is sum_r M_r u_{a_r(s)} with Gaussian
    M_r / sqrt(d_u), the tokens E scaled to the code's variance, isotropic noise at ``snr`` of the code's variance."""
    gen = torch.Generator().manual_seed(seed)
    n, d = E.shape
    maps = [torch.randn(d, U_r.shape[1], generator=gen, dtype=torch.float64) / U_r.shape[1] ** 0.5 for U_r in U]
    table = A
    if world.kind == "shuffled":
        table = A.clone()
        for r in range(A.shape[1]):
            table[:, r] = A[torch.randperm(n, generator=gen), r]
    code = sum(U_r.double()[table[:, r]] @ M.T for r, (U_r, M) in enumerate(zip(U, maps)))
    signal = float(code.var(0).sum())
    tokens = E.double() * (signal / float(E.double().var(0).sum())) ** 0.5
    noise = torch.randn(n, d, generator=gen, dtype=torch.float64) * (signal / world.snr / d) ** 0.5
    if world.kind == "tokens":
        return tokens.clone(), tokens, maps
    H = tokens + code + noise
    return H, (H if world.kind == "lexical" else tokens), maps


def lre_faithfulness(H: torch.Tensor, H0: torch.Tensor, a: torch.Tensor, U_r: torch.Tensor, M: torch.Tensor,
                     n_used: int, n_test: int, seed: int) -> dict:
    """LRE faithfulness of one relation on a planted world, the run's way at its sizes: ``n_used`` known facts
    (subjects drawn at random), the last ``n_test`` of them held out; the operator W = M^T (the reading map of
    the planted code, M^T M ~ I: what the mean Jacobian of a model that reads the code is), o_hat = W h + b with b
    fitted on the other known facts (the model's output o = u_a: it answers every fact); a hit when the object's
    vector is the nearest to o_hat among the relation's answers (cosine, both centred on the answers' mean: the
    readout's metric, standing in for the LM head). Nulls: ``majority`` (the fit facts' most common answer) and
    ``lexical`` (the same W on the tokens' component H0, b refitted). JSON metric (Wilson over the n_test
    subjects)."""
    gen = torch.Generator().manual_seed(seed)
    known = torch.randperm(len(a), generator=gen)[:n_used]
    fit, test = known[:n_used - n_test], known[n_used - n_test:]
    W, O = M.T, U_r.double()[a]
    merged, (U_r,), _ = merge_equal_attributes(a[:, None], [U_r.double()])    # one answer per first token
    a = merged[:, 0]
    centre = U_r.mean(0)                                        # the model's output O points at its answer
    answers = torch.nn.functional.normalize(U_r - centre, dim=1)

    def hits(states: torch.Tensor) -> list[float]:
        b = (O[fit] - states[fit] @ W.T).mean(0)
        o_hat = torch.nn.functional.normalize(states[test] @ W.T + b - centre, dim=1)
        return (o_hat @ answers.T).argmax(1).eq(a[test]).double().tolist()

    majority = torch.bincount(a[fit], minlength=U_r.shape[0]).argmax()
    nulls = {"majority": proportion(a[test].eq(majority).double().tolist()), "lexical": proportion(hits(H0))}
    return proportion(hits(H)).with_nulls(nulls, "majority").to_dict()


def answers_per_subject(a: torch.Tensor, U_r: torch.Tensor) -> float:
    """Distinct answers per subject of one relation (``a`` [n], equal rows of U_r merged, as the readout merges
    them): what ``claims.READOUT_MAX_ANSWERS_PER_SUBJECT`` bounds."""
    merged, _, _ = merge_equal_attributes(a[:, None], [U_r])
    return len(torch.unique(merged)) / len(a)


def grade_against(metric: dict, margins: dict, nulls: tuple[str, ...], family: int) -> str:
    """The verdict rule on one accuracy test against ``nulls`` (paired margins where given), Bonferroni over
    ``family`` tests (Holm's strictest step, as :func:`grade`): supported / weak / not shown."""
    diffs = [difference(metric, metric["nulls"][name], margins.get(name)) for name in nulls]
    p = min(1.0, family * max(p_above(d, MIN_EFFECT[DECODABLE]) for d in diffs))
    p_zero = min(1.0, family * max(p_above(d, 0.0) for d in diffs))
    return "supported" if p < ALPHA else "weak" if p_zero < ALPHA else "not shown"


def measure_decodable_world(world: DecodableWorld, A: torch.Tensor, U: list, E: torch.Tensor, names: list[str],
                            seed: int, sizes: dict | None = None, family: int = DECODABLE_FAMILY, folds: int = 5,
                            jackknife_groups: int = 20) -> dict:
    """One draw of ``world``: per relation {"readout", "lre" (values), "readout_grade" ("not testable here" above
    ``READOUT_MAX_ANSWERS_PER_SUBJECT``), "lre_grade", "grade" (the better: the line's grade of the relation)},
    and "line": the line's verdict (the grade at least half the relations reach). ``sizes``: {relation: (known
    facts, test subjects)} of the LRE (default ``LRE_SIZES``)."""
    sizes = sizes or LRE_SIZES
    H, H0, maps = decodable_states(world, A, U, E, seed)
    rep = superposition_readout(H, A, U, relation_names=names, nulls={"lexical": H0}, k=folds, seed=seed,
                                decode=False, jackknife_groups=jackknife_groups)
    out: dict = {"relations": {}}
    for r, name in enumerate(names):
        readout = rep.measure("readout_acc", name).to_dict()
        margins = {null: m["readout_acc"][name].to_dict() for null, m in rep.margins.items()}
        testable = answers_per_subject(A[:, r], U[r]) <= READOUT_MAX_ANSWERS_PER_SUBJECT
        lre = lre_faithfulness(H, H0, A[:, r], U[r], maps[r], *sizes[name], seed=seed + 1000 * r)
        grades = {"readout_grade": grade_against(readout, margins, READOUT_NULLS, family) if testable else
                  NOT_TESTABLE, "lre_grade": grade_against(lre, {}, LRE_NULLS, family)}
        best = min(grades.values(), key=GRADES.index)
        grades["lre_majority_grade"] = grade_against(lre, {}, ("majority",), family)   # without the lexical null
        out["relations"][name] = {"readout": readout["value"], "lre": lre["value"],
                                  "lre_lexical": lre["nulls"]["lexical"]["value"], **grades, "grade": best}
    ranked = sorted((v["grade"] for v in out["relations"].values()), key=GRADES.index)
    out["line"] = ranked[(len(ranked) - 1) // 2]
    return out


def calibrate_decodable(worlds: list[DecodableWorld], A: torch.Tensor, U: list, E: torch.Tensor, names: list[str],
                        replicates: int, sizes: dict | None = None, family: int = DECODABLE_FAMILY, folds: int = 5,
                        jackknife_groups: int = 20, on_row=None) -> list[dict]:
    """One row per world and relation (and one for the line): mean readout accuracy, LRE faithfulness and its
    lexical null, and per test (readout, lre, the relation's better one; the line) the fraction of replicates
    graded supported and supported or weak: power where the claim holds, false-positive rate where it fails;
    a readout the rule marks "not testable here" counts as neither."""
    rows = []
    for world in worlds:
        draws = [measure_decodable_world(world, A, U, E, names, seed, sizes, family, folds, jackknife_groups)
                 for seed in range(replicates)]
        for name in [*names, "line"]:
            got = [d["relations"][name] if name != "line" else {"grade": d["line"]} for d in draws]
            row = {"world": world.name, "claim_holds": world.holds, "relation": name, "replicates": replicates,
                   "family": family}
            for key in ("readout", "lre", "lre_lexical"):
                if name != "line":
                    row[key] = sum(g[key] for g in got) / replicates
            if name != "line":
                row["answers_per_subject"] = answers_per_subject(A[:, names.index(name)], U[names.index(name)])
                row["testable"] = got[0]["readout_grade"] != NOT_TESTABLE
            tests = {key: [g[f"{key}_grade"] for g in got] for key in ("readout", "lre", "lre_majority")
                     if name != "line"}
            tests["relation" if name != "line" else "line"] = [g["grade"] for g in got]
            row.update(graded_fractions(tests, replicates))
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def format_decodable_rows(rows: list[dict]) -> str:
    """The decodable calibration table as text: per world and relation the readout accuracy, LRE faithfulness and
    its lexical null, then supported / supported or weak per test (the readout's "not testable here" written so),
    the relation's better test, and the LRE graded against majority alone (what the lexical null removes)."""
    out = [f"{'world':44s} {'holds':5s} {'relation':18s} {'ans/subj':>8s} {'readout':>7s} {'LRE':>5s} {'LRE lex':>7s}"
           f"  {'readout: supp / +weak':>21s}  {'LRE: supp / +weak':>17s}  {'better: supp / +weak':>20s}"
           f"  {'LRE vs majority only':>20s}"]
    for r in rows:
        if r["relation"] == "line":
            out.append(f"{r['world']:44s} {'yes' if r['claim_holds'] else 'no':5s} {'(the line)':18s} {'':>8s} "
                       f"{'':>7s} {'':>5s} {'':>7s}  {'':>21s}  {'':>17s}  {r['line_supported']:11.2f} / "
                       f"{r['line_supported_or_weak']:5.2f}")
            continue
        readout = (f"{r['readout_supported']:13.2f} / {r['readout_supported_or_weak']:5.2f}" if r["testable"] else
                   f"{'not testable':>21s}")
        out.append(f"{r['world']:44s} {'yes' if r['claim_holds'] else 'no':5s} {r['relation']:18s} "
                   f"{r['answers_per_subject']:8.2f} {r['readout']:7.3f} {r['lre']:5.2f} {r['lre_lexical']:7.2f}  "
                   f"{readout}  {r['lre_supported']:9.2f} / {r['lre_supported_or_weak']:5.2f}  "
                   f"{r['relation_supported']:12.2f} / {r['relation_supported_or_weak']:5.2f}  "
                   f"{r['lre_majority_supported']:12.2f} / {r['lre_majority_supported_or_weak']:5.2f}")
    return "\n".join(out)


def readout_testability(A: torch.Tensor, U: list, E: torch.Tensor, names: list[str], answers: list[int], snr: float,
                        replicates: int, family: int = DECODABLE_FAMILY, folds: int = 5, jackknife_groups: int = 20,
                        on_row=None) -> list[dict]:
    """Where the readout can test a relation at this n: relation 0 of the table replaced by a random map of the
    subjects onto k of its answers (every one used; vectors: k of its rows), planted with the other relations
    (:func:`planted_superposition` at ``snr``), its readout graded against shuffled and lexical (the subjects'
    token embeddings E). One row per k in ``answers``: answers per subject (k / n), the share of subjects alone
    with their answer, the mean readout accuracy and the fraction graded supported (``READOUT_MAX_ANSWERS_PER_
    SUBJECT`` is set where it falls below 0.8)."""
    n = A.shape[0]
    rows = []
    for k in answers:
        accuracy, alone, grades = [], [], []
        for seed in range(replicates):
            gen = torch.Generator().manual_seed(seed)
            column = torch.cat([torch.arange(k), torch.randint(0, k, (n - k,), generator=gen)])
            table = A.clone()
            table[:, 0] = column[torch.randperm(n, generator=gen)]
            vectors = [U[0][torch.randperm(U[0].shape[0], generator=gen)[:k]], *U[1:]]
            H = planted_superposition(table, vectors, E.shape[1], snr, seed)
            rep = superposition_readout(H, table, vectors, relation_names=names, nulls={"lexical": E}, k=folds,
                                        seed=seed, decode=False, jackknife_groups=jackknife_groups)
            readout = rep.measure("readout_acc", names[0]).to_dict()
            margins = {null: m["readout_acc"][names[0]].to_dict() for null, m in rep.margins.items()}
            accuracy.append(readout["value"])
            alone.append(float((torch.bincount(table[:, 0], minlength=k) == 1).sum()) / n)
            grades.append(grade_against(readout, margins, READOUT_NULLS, family))
        row = {"snr": snr, "answers": k, "answers_per_subject": k / n, "alone": sum(alone) / replicates,
               "readout": sum(accuracy) / replicates, "replicates": replicates,
               "supported": sum(g == "supported" for g in grades) / replicates}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def format_testability_rows(rows: list[dict]) -> str:
    """The readout's testability sweep as text."""
    out = [f"{'snr':>5s} {'answers':>7s} {'ans/subj':>8s} {'alone':>5s} {'readout':>7s} {'reps':>4s} {'supported':>9s}"]
    out += [f"{r['snr']:5g} {r['answers']:7d} {r['answers_per_subject']:8.2f} {r['alone']:5.2f} {r['readout']:7.3f} "
            f"{r['replicates']:4d} {r['supported']:9.2f}" for r in rows]
    return "\n".join(out)
