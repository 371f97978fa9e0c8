"""Reports: report.json -> self-contained HTML (plots embedded), Markdown and CSV tables; side-by-side comparison.
The claims' verdicts are :mod:`llmprobe.report.claims`, the plots :mod:`llmprobe.report.figures`, the tidy metric
rows (one per number: a measure's value, then each of its controls) :func:`llmprobe.report.schema.metric_rows`,
so the same renderers serve a single run and a comparison of many.
"""
from __future__ import annotations

import base64
import csv
import html
import io
import json
from pathlib import Path

from llmprobe.analyses.results import (
    DatasetInfo,
    MatchedBlock,
    MatchedSource,
    RelationFacts,
    Training,
    metric_nulls,
    metric_value,
)
from llmprobe.checks import UsageError, report_formats
from llmprobe.io import BIDI_ESCAPES, MANIFEST, note_written, read_manifest, remove_outputs, write_json, write_text
from llmprobe.metric import iter_metrics
from llmprobe.names import REPORT_FILES
from llmprobe.report.claims import (
    CAPACITY,
    CAUSAL,
    DECODABLE,
    MULTIHOP,
    SELECTOR,
    SERVES,
    SUPERPOSITION,
    VERDICT_RULE,
    claims_block,
)
from llmprobe.report.figures import figure_key, png_data_uri, report_figures
from llmprobe.report.schema import (
    ROW_FIELDS,
    analyses_of,
    matched_sources,
    metric_rows,
    missing_stages,
    read_report,
    settings_of,
    source_name,
)

CLAIM_FIELDS = ("verdict", "hardest_null", "hardest_null_value", "difference", "difference_lo", "difference_hi",
                "difference_interval", "min_effect", "p_holm", "n_tests", "comparison", "comparison_value",
                "note")   # claim rows only (claim_rows)


def claim_rows(report: dict) -> list[dict]:
    """One row per claim of a pretrained report's claims block (:func:`llmprobe.report.claims.claims_block`): a
    value row of the metric rows' columns (``measure`` = "claim: ...", relation and layer shown, the number, its
    interval and n; ``null`` empty: it is a value row) and ``CLAIM_FIELDS`` (its hardest null in ``hardest_null``,
    ``hardest_null_value``);
    none for a synthetic report."""
    if report.get("kind") == "synthetic":
        return []
    block = claims_block(report)
    n_layers = max(report.get("model", {}).get("n_layers") or 1, 1)
    rows = []
    for line in block["lines"]:
        metric, null = line["metric"] or {}, line["null"] or {}
        lo, hi = (metric.get("ci") or [None, None])[:2]
        diff, comparison = line["difference"] or {}, line["comparison"] or {}
        layer = line["layer"]
        row = dict(zip(ROW_FIELDS, (source_name(report), report.get("kind", "pretrained"), line["relation"], layer,
                                    None if layer is None else layer / (n_layers - 1) if n_layers > 1 else 0.0,
                                    f"claim: {line['claim']}", None, metric.get("value"), lo, hi, metric.get("n")),
                       strict=True))
        d_lo, d_hi = (diff.get("ci") or [None, None])[:2]
        rows.append(row | dict(zip(CLAIM_FIELDS, (
            line["verdict"], line["null_name"], null.get("value"), diff.get("value"), d_lo, d_hi,
            diff.get("interval"), line["min_effect"], line["p_holm"], block["n_tests"],
            " ".join(filter(None, [comparison.get("word"), comparison.get("name")])) or None,
            metric_value(comparison.get("metric")), line["note"] or None), strict=True)))
    return rows


def write_csv(rows: list[dict], path: str | Path) -> Path:
    """The metric rows (and claim rows, ``CLAIM_FIELDS``) as one CSV table (atomic write); text cells that a
    spreadsheet would run as a formula are neutralised (:func:`csv_safe`)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=ROW_FIELDS + CLAIM_FIELDS, restval="")
    writer.writeheader()
    writer.writerows({k: csv_safe(v) for k, v in row.items()} for row in rows)
    return write_text(path, visible(buffer.getvalue()))


# control characters (C0 but tab, line feed and carriage return; DEL; C1) and the bidirectional controls that
# reorder what a reader sees (a right-to-left override makes "cap<RLO>txt.exe" read "capexe.txt"): each is written
# as its escape (\x00, \u202e), so a user string (a model or relation name) shows what it holds
HIDDEN = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7f, 0xa0)) if chr(code) not in "\t\n\r"} | \
    BIDI_ESCAPES


def visible(text: str) -> str:
    """``text`` with the characters of ``HIDDEN`` written as their escapes; any other text is returned as it is."""
    return text.translate(HIDDEN)


def csv_safe(value):
    """A text cell starting with ``= + - @``, tab or CR gets a leading ``'`` so that spreadsheets show it as
    text instead of running it as a formula; numbers (and text that reads as a number, like ``-0.12``) stay."""
    if isinstance(value, str) and value.startswith(("=", "+", "-", "@", "\t", "\r")):
        try:
            float(value)
        except ValueError:
            return "'" + value
    return value


def _fmt(value, digits=3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table_html(header: list[str], body: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    lines = ["<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in body]
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"


def _md(text) -> str:
    """Any text for Markdown, on one line: HTML escaped (no tag reaches a renderer that allows HTML), line breaks
    folded into spaces (no injected headings or list items), backslashes and table pipes escaped."""
    text = html.escape(str(text), quote=False).replace("\\", "\\\\").replace("|", "\\|")
    return " ".join(text.splitlines())


def _table_md(header: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(_md(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md(_fmt(c)) for c in row) + " |" for row in body]
    return "\n".join(lines)


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def _with_ci(m: dict | None) -> str:
    """'value [lo, hi] (n=N)' of a typed metric, '-' when absent."""
    if not m or m.get("value") is None:
        return "-"
    lo, hi = (m.get("ci") or [None, None])[:2]
    text = _fmt(m["value"]) + (f" [{_fmt(lo, 2)}, {_fmt(hi, 2)}]" if lo is not None and hi is not None else "")
    return text + (f" (n={m['n']})" if m.get("n") is not None else "")


def _control_text(m: dict | None, *names: str) -> str:
    """'name value' of the named controls (default: the primary one) of a typed metric."""
    if not m:
        return "-"
    controls = m.get("nulls") or {}
    names = names or ((m["primary_null"],) if m.get("primary_null") else ())
    return ", ".join(f"{n} {_fmt(controls[n].get('value'))}" for n in names if n in controls) or "-"


def _null_names(m: dict | None) -> list[str]:
    """The names of a metric's nulls, in its order ([] for none or no metric)."""
    return list(metric_nulls(m))


def selected_rows(report: dict) -> list[list]:
    """Per relation and decoder, at the layers chosen on validation (``analyses.relations.R.selected``): test
    faithfulness and causality with n, interval and every control."""
    rows = []
    for name, rel in analyses_of(report).relations.items():
        for method, sel in rel.selected.items():
            faith = rel.at(sel.layer).decoder(method).faithfulness
            causal = rel.at(sel.causality_layer).decoder(method).causality if sel.causality_layer is not None \
                else None
            rows.append([source_name(report), name, method, sel.layer, _with_ci(faith),
                         _control_text(faith, *_null_names(faith)), sel.causality_layer,
                         _with_ci(causal), _control_text(causal, *_null_names(causal))])
    return rows


def _null_value(m: dict, name: str):
    """The value of a metric's null ``name``; None when it has no such null."""
    return metric_nulls(m).get(name, {}).get("value")


def superposition_rows(report: dict) -> list[list]:
    """Per layer: R^2 with its controls, mean readout accuracy with its shuffled control, swap edit where run."""
    rows = []
    layers = analyses_of(report).superposition.layers
    for layer, entry in sorted(layers.items(), key=lambda kv: int(kv[0])):
        readout = [m for m in entry.readout.values() if m.get("value") is not None]
        acc = _mean([m["value"] for m in readout])
        acc_shuffled = _mean([m["nulls"]["shuffled"]["value"] for m in readout
                             if _null_value(m, "shuffled") is not None])
        scales = entry.swap.by_scale
        fitted = scales[0] if scales else None
        rows.append([source_name(report), int(layer), _with_ci(entry.r2),
                     _control_text(entry.r2, "shuffled", "random_init"), acc, acc_shuffled,
                     _with_ci(fitted.success) if fitted else "not run at this layer",
                     _control_text(fitted.success, "random_direction") if fitted else "-",
                     _with_ci(fitted.others_unchanged) if fitted else "-",
                     "; ".join(f"x{b.scale:g}: {_fmt(b.success['value'], 2)} "
                               f"({_fmt(b.success['nulls']['random_direction']['value'], 2)}) / "
                               f"{_fmt(b.others_unchanged['value'], 2)}" for b in scales) or "-"])
    return rows


def superposition_part_rows(report: dict) -> list[list]:
    """Per layer with the fits of the lexical rule (``graded_layers``): the R^2 of every relation, of the relations
    not flagged lexical (the claim's), then per relation the gain over random_attributes without its term and its
    contribution to the gain (every relation's gain - that), beside its lexical overlap. Older reports: none."""
    superposition = analyses_of(report).superposition
    overlap = superposition.lexical_overlap or {}
    rows = []
    for layer, entry in sorted(superposition.layers.items(), key=lambda kv: int(kv[0])):
        if int(layer) not in (superposition.graded_layers or []):
            continue
        gain = (entry.r2 or {}).get("gain")
        rows.append([source_name(report), int(layer), "every relation", _with_ci(entry.r2), _with_ci(gain), "-", "-"])
        if entry.r2_non_lexical:
            rows.append([source_name(report), int(layer), "not lexical (the claim's): " +
                         ", ".join(entry.r2_non_lexical.get("relations") or []), _with_ci(entry.r2_non_lexical),
                         _with_ci(entry.r2_non_lexical.get("gain")), "-", "-"])
        for relation, part in entry.contributions.items():
            lex = overlap.get(relation) or {}
            rows.append([source_name(report), int(layer), f"without {relation}", "-", _with_ci(part.get("gain_without")),
                         _with_ci(part.get("contribution")),
                         (f"{'lexical' if lex.get('lexical') else 'no'}: excess cosine {_fmt(lex.get('excess_cosine'), 2)}"
                          f", first token shared {lex.get('shared_first_token')}/{lex.get('n')}") if lex else "-"])
    return rows


def _train_cells(train: Training) -> list:
    """The controls table's "train acc" and "steps" cells: over the point's seeds (mean, min, how many reached
    100%; fewest-most steps) where the report has them, else the one training's."""
    seeds = train.over_seeds
    if not seeds:
        return [train.accuracy, train.steps]
    low, high = seeds["steps"]
    accuracy = (f"{seeds['accuracy_mean']:.3f} (min {seeds['accuracy_min']:.3f})"
                if seeds["accuracy_min"] < seeds["accuracy_mean"] else f"{seeds['accuracy_mean']:.3f}")
    return [f"{accuracy}; {seeds['n_fit']}/{seeds['n']} seeds fit", str(low) if low == high else f"{low}-{high}"]


def matched_rows(report: dict) -> list[list]:
    """One row per synthetic report (a matched control): width, training, readouts, selector numbers."""
    if report.get("kind") != "synthetic":
        return []
    source = MatchedSource.from_dict(report)
    train = source.train
    layer = source.analyses.superposition.at(0)
    readout = [m["value"] for m in layer.readout.values() if m.get("value") is not None]
    selector = source.analyses.selector
    transplant = selector.gate_transplant
    return [[source_name(report), report.get("model", {}).get("d_model"), source.threshold.d_star, *_train_cells(train),
             f"{train.bits_per_param:.3g}" if isinstance(train.bits_per_param, (int, float)) else None,
             _with_ci(layer.r2),
             _control_text(layer.r2, "shuffled", "random_init"),
             _mean(readout),
             selector.relation_gating.mean, transplant.same_relation,
             transplant.same_subject]]


def transplant_rows(report: dict) -> list[list]:
    """Per relation of the pretrained model's gate-transplant test facts (``selector.gate_transplant.by_relation``):
    the answers kept clean, with another subject's gates of the same relation, with the same subject's gates of
    another relation and with as many random units switched off, and the selector line's difference: the share
    another relation's gates break less the share random units break (random_minus_other of the kept)."""
    transplant = analyses_of(report).selector.gate_transplant
    if report.get("kind") == "synthetic" or not transplant.by_relation:
        return []
    block = transplant.block
    where = f"{block[0]}-{block[-1]}" if block else "-"
    rows = []
    for name, part in transplant.by_relation.items():
        if part.error:
            rows.append([source_name(report), name, where, part.n_items, part.error, "-", "-", "-", "-"])
            continue
        rows.append([source_name(report), name, where, part.n_items, _with_ci(part.clean),
                     _with_ci(part.same_relation), _with_ci(part.other_relation),
                     _with_ci(part.random_units), _difference_text(part.random_minus_other)])
    return rows


# the analyses block's entries the tables and claims above read in their own layout, and its bookkeeping; every
# other entry (an analysis registered beside these, ``llmprobe.analyses.registry``) gets a table of its metrics
OWN_LAYOUT = ("settings", "partial", "relations", "errors", "timing", "superposition", "crosspatch", "selector",
              "multihop")


def other_analysis_rows(report: dict) -> dict[str, list[list]]:
    """Analysis name -> one row per typed metric of an analyses entry without a layout of its own (source, the
    metric's place in the entry, value [95% CI], n, its primary null with value): how a newly registered analysis
    is shown until it has a table of its own."""
    out = {}
    for name, entry in (report.get("analyses") or {}).items():
        if name in OWN_LAYOUT or not isinstance(entry, dict):
            continue
        rows = []
        for path, m in iter_metrics(entry):
            null = m.get("primary_null")
            rows.append([source_name(report), ".".join(path), _with_ci(m), m.get("n"),
                         f"{null} {_with_ci(metric_nulls(m).get(null))}" if null else ""])
        if rows or entry.get("error"):
            out[name] = rows or [[source_name(report), "error", str(entry["error"]), None, ""]]
    return out


def summary_tables(reports: list[dict], rows: list[dict]) -> list[tuple[str, list[str], list[list]]]:
    """(title, header, body) tables shared by the HTML and Markdown renderers."""
    tables = []
    models = [[source_name(r), r.get("kind"), _model_path(r), r.get("model", {}).get("architecture"),
               r.get("model", {}).get("n_layers"), r.get("model", {}).get("d_model"),
               (r.get("model", {}).get("weights_hash") or "")[:19],
               f"{r['wall_seconds']:.1f}" if isinstance(r.get("wall_seconds"), (int, float)) else None]
              for r in reports]
    tables.append(("Sources", ["source", "kind", "model (name or path)", "architecture", "layers", "d_model",
                               "weights", "wall s"], models))
    known = [[r["source"], r["relation"], r["n"], r["value"]] for r in rows if r["measure"] == "known_rate"]
    if known:
        tables.append(("Known facts (greedy continuation starts with the object)",
                       ["source", "relation", "facts", "known rate"], known))
    chat = [[source_name(r), wrapping["instruction"], json.dumps(wrapping["example"], ensure_ascii=False)]
            for r in reports for wrapping in [DatasetInfo.from_dict(r.get("dataset")).chat_template] if wrapping]
    if chat:
        tables.append(("Prompts in the model's chat template (--chat-template): a user turn with the instruction, then "
                       "the prompt as the start of the assistant's answer (line breaks as \\n)",
                       ["source", "instruction", "first template as wrapped"], chat))
    selected = [row for report in reports for row in selected_rows(report)]
    if selected:
        tables.append(("Linear relation decoders at the layer chosen on validation (fixed test subjects; value "
                       "[95% CI] (n test items); causality = the reference edit W^+ (o_t - o_s))",
                       ["source", "relation", "decoder", "layer", "faithfulness", "nulls", "causality layer",
                        "causality", "nulls"], selected))
    superposition = [row for report in reports for row in superposition_rows(report)]
    if superposition:
        tables.append(("Superposition readouts of relation-free subject states, per layer (cross-fitted)",
                       ["source", "layer", "R^2", "R^2 controls", "mean readout accuracy", "shuffled",
                        "swap success", "swap control", "others unchanged",
                        "swap by edit scale: success (random dir.) / others unchanged"], superposition))
    parts = [row for report in reports for row in superposition_part_rows(report)]
    if parts:
        tables.append(("Superposition R^2 by relation: the claim's fit leaves out the relations flagged lexical "
                       "(docs/measures.md); a relation's contribution = the gain over random_attributes with every "
                       "relation - without its term (paired jackknife)",
                       ["source", "layer", "fit", "R^2", "gain over random_attributes", "contribution to the gain",
                        "lexical (rule)"], parts))
    transplants = [row for report in reports for row in transplant_rows(report)]
    if transplants:
        tables.append(("MLP gate transplant per relation (test facts, at the block chosen on validation facts; "
                       "fraction of known answers kept; the selector line pools these)",
                       ["source", "relation", "layers", "facts", "clean", "same relation, other subject",
                        "other relation, same subject", "random units",
                        "broken: other relation - random units"], transplants))
    controls = [row for report in reports for row in matched_rows(report)]
    if controls:
        tables.append(("Matched synthetic controls (readouts of their subject embeddings e_s; what they were trained "
                       "on: controls.compared_with in report.json)",
                       ["matched model", "d", "d*", "train acc", "steps", "bits/param", "R^2", "R^2 nulls",
                        "mean readout accuracy", "relation gating", "gate transplant (same relation)",
                        "gate transplant (other relation)"], controls))
    others: dict[str, list[list]] = {}
    for report in reports:
        for name, body in other_analysis_rows(report).items():
            others.setdefault(name, []).extend(body)
    for name, body in others.items():
        tables.append((f"Analysis {name}: its metrics", ["source", "metric", "value [95% CI]", "n", "primary null"],
                       body))
    return tables


def _model_path(report: dict) -> str | None:
    """The model's name or path as recorded, where the source's short name leaves part of it out."""
    name = report.get("model", {}).get("name")
    return name if report.get("kind") != "synthetic" and name != source_name(report) else None


SUMMARY_HEADER = ["claim", "measure", "shown", "number [95% CI] (n)", "null", "difference [95% CI]",
                  "minimal effect", "Holm p", "verdict", "note", "comparison"]
VERDICT_COLUMN = SUMMARY_HEADER.index("verdict")
LONG_TABLE = 15          # tables with more rows than this are folded into <details> (no JavaScript needed)


def _difference_text(diff: dict | None) -> str:
    if not diff or diff.get("value") is None:
        return "-"
    lo, hi = (diff.get("ci") or [None, None])[:2]
    ends = f" [{_fmt(lo, 2)}, {_fmt(hi, 2)}]" if lo is not None and hi is not None else ""
    return f"{diff['value']:+.3f}{ends} ({diff['interval']})"


def _summary_lines(reports: list[dict]) -> list[tuple[str, dict]]:
    """(prefix, line) of every line of every pretrained report's claims block; the prefix is the source's name
    when there are several, else empty."""
    pretrained = [r for r in reports if r.get("kind") != "synthetic"]
    return [(f"{source_name(report)}: " if len(pretrained) > 1 else "", line) for report in pretrained
            for line in claims_block(report)["lines"]]


def _summary_row(prefix: str, line: dict) -> list:
    shown = ", ".join(filter(None, [line["relation"], None if line["layer"] is None else f"layer {line['layer']}"]))
    comparison = line["comparison"]
    return [prefix + line["claim"], line["measure"], shown or "-", _with_ci(line["metric"]),
            f"{line['null_name']}: {_with_ci(line['null'])}" if line["null_name"] else "-",
            _difference_text(line["difference"]),
            "-" if line["min_effect"] is None else f"+{line['min_effect']:g}",
            "-" if line["p_holm"] is None else f"{line['p_holm']:.2g}", line["verdict"],
            line["note"] or "-", f"{comparison['word']} {comparison['name']}: {_with_ci(comparison['metric'])}"
            if comparison else "-"]


def summary_rows(reports: list[dict]) -> list[list]:
    """The summary's lines (``SUMMARY_HEADER``) of every pretrained report's claims block, its source first when
    there are several."""
    return [_summary_row(prefix, line) for prefix, line in _summary_lines(reports)]


# the summary table's measure cell: a short name per claim (the full measure is the cell's title and a numbered
# note below the table), so that the table fits a 1200 px window
MEASURE_LABELS = {DECODABLE: "LRE faithfulness or readout accuracy", CAUSAL: "LRE causality",
                  SUPERPOSITION: "held-out R^2 of the sum", SERVES: "crosspatch success rate",
                  SELECTOR: "facts a gate transplant breaks", MULTIHOP: "chain-of-thought accuracy",
                  CAPACITY: "bits per trainable parameter"}
SUMMARY_WIDTHS = (10, 9, 10, 8, 11, 9, 5, 5, 8, 12, 13)     # % of the table per column of SUMMARY_HEADER
LABEL_CHARS = 40          # a measure without a label in MEASURE_LABELS: its name, at most this long


def measure_label(claim: str, measure: str) -> str:
    """The short name of a claim's measure: ``MEASURE_LABELS``, else the measure's text up to its first ':',
    ' (' or ',' (cut to ``LABEL_CHARS``)."""
    if claim == SELECTOR and "kept with another subject's" in measure:      # the calibrated keep test
        return "facts kept with another subject's gates"
    if claim in MEASURE_LABELS:
        return MEASURE_LABELS[claim]
    name = min((measure.split(mark, 1)[0] for mark in (":", " (", ",")), key=len)
    return name if len(name) <= LABEL_CHARS else name[:LABEL_CHARS - 1].rstrip() + "\u2026"


def _breakable(value) -> str:
    """A cell's text, escaped, that may wrap after each '_' and '/' (relation and null names are long words)."""
    return html.escape(_fmt(value)).replace("_", "_<wbr>").replace("/", "/<wbr>")


def summary_table_html(reports: list[dict], anchor: str = "measure") -> str:
    """The summary's lines (``SUMMARY_HEADER``) as a table that fits a 1200 px window: the measure cell a short
    name (:func:`measure_label`) with the full measure as its title and as a numbered note below the table (each
    text once; ``anchor`` prefixes the notes' ids), the verdict cell coloured by grade, every column wrapping."""
    lines = _summary_lines(reports)
    if not lines:
        return "<p>No pretrained report: no claim is measured on this page.</p>"
    notes = list(dict.fromkeys(line["measure"] for _, line in lines))
    head = "".join(f"<th>{html.escape(h)}</th>" for h in SUMMARY_HEADER)
    body = []
    for prefix, line in lines:
        cells = [f"<td>{_breakable(c)}</td>" for c in _summary_row(prefix, line)]
        verdict = line["verdict"]
        cells[VERDICT_COLUMN] = f"<td class='verdict {verdict.replace(' ', '-')}'>{html.escape(verdict)}</td>"
        number = notes.index(line["measure"]) + 1
        cells[1] = (f"<td class='measure' title='{html.escape(line['measure'])}'>"
                    f"{html.escape(measure_label(line['claim'], line['measure']))}"
                    f"<sup><a href='#{anchor}-{number}'>{number}</a></sup></td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    widths = "".join(f"<col style='width:{w}%'>" for w in SUMMARY_WIDTHS)
    return (f"<table class='claims'><colgroup>{widths}</colgroup><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>"
            "<p class='measures'>What each number measures:</p><ol class='measures'>" +
            "".join(f"<li id='{anchor}-{k}'>{html.escape(text)}</li>" for k, text in enumerate(notes, 1)) + "</ol>")


def partial_lines(reports: list[dict]) -> list[str]:
    """One line per stage a pretrained report of the page lacks (:func:`llmprobe.report.schema.missing_stages`),
    its source first when the page has several."""
    pretrained = [r for r in reports if r.get("kind") != "synthetic"]
    return [f"{source_name(r) + ': ' if len(pretrained) > 1 else ''}{line}" for r in pretrained
            for line in missing_stages(r)]


RUN_SETTINGS = ("layers", "seed", "max_facts", "max_prompt_tokens")     # run settings that change what is measured


def measured_differences(reports: list[dict]) -> list[str]:
    """One warning per difference in what the pretrained reports of a comparison measured: their relations, the
    facts of the relations they share, the analyses and the settings that change numbers (``RUN_SETTINGS``,
    every analysis setting), and their matched controls (present, settings, fact table); [] for one report."""
    pretrained = [r for r in reports if r.get("kind") != "synthetic"]
    if len(pretrained) < 2:
        return []
    names = [source_name(r) for r in pretrained]
    lines = []
    relations = [list(r.get("relations") or {}) for r in pretrained]
    shared = [n for n in relations[0] if all(n in rs for rs in relations)]
    if any(set(rs) != set(shared) for rs in relations):
        lines.append("relations differ: " + "; ".join(
            [f"in all: {', '.join(shared) or 'none'}"] + [f"only in {name}: {', '.join(n for n in rs if n not in shared)}"
                                                         for name, rs in zip(names, relations) if set(rs) != set(shared)]))
    counts = {n: [RelationFacts.from_dict(r["relations"][n]).n_facts for r in pretrained] for n in shared}
    if any(len(set(c)) > 1 for c in counts.values()):
        lines.append("facts differ: " + "; ".join(f"{n} has {' vs '.join(map(str, c))} facts" for n, c in counts.items()
                                                  if len(set(c)) > 1) + f" ({' vs '.join(names)})")
    settings = [settings_of(r) for r in pretrained]
    sections = [("analyses run", [s.run.get("analyses") for s in settings])]
    sections += [(f"run.{key}", [s.run.get(key) for s in settings]) for key in RUN_SETTINGS]
    analysis_keys = sorted({k for s in settings for k in s.analysis})
    sections += [(f"analysis.{key}", [s.analysis.get(key) for s in settings]) for key in analysis_keys]
    if all(s.matched for s in settings):      # a report without matched controls: their line says so once
        matched_keys = sorted({k for s in settings for k in s.matched})
        sections += [(f"matched.{key}", [s.matched.get(key) for s in settings]) for key in matched_keys]
    sections.append(("prompts in the chat template", [bool(DatasetInfo.from_dict(r.get("dataset")).chat_template)
                                                      for r in pretrained]))
    sections.append(("matched controls", [_matched_text(r) for r in pretrained]))
    for what, values in sections:
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) > 1:
            lines.append(f"{what} differ: " + "; ".join(f"{name}: {_fmt(v) if not isinstance(v, list) else ', '.join(map(str, v)) or 'none'}"
                                                     for name, v in zip(names, values)))
    return lines


def _matched_text(report: dict) -> str:
    """What a report's matched controls were: their modes, widths and fact table, or none."""
    block = report.get("matched")
    if not block:
        return "none"
    if not isinstance(block, dict):
        return f"{len(block)} controls (an older report)"
    def text(block: dict) -> str:
        typed = MatchedBlock.from_dict(block)
        table = typed.table
        modes = "; ".join(f"{mode} d = {', '.join(str(p['d']) for p in entry.get('points') or [])}"
                          for mode, entry in (block.get("modes") or {}).items())
        described = f"; {typed.described()}" if table.facts else ""     # older reports: as they were written
        return (f"{modes} on {table.n_subjects} subjects x {len(table.relations or [])} relations "
                f"({table.n_facts} facts{described})")
    apart = block.get("all_facts")
    return text(block) + (f"; shown apart, not graded: {text(apart)}" if isinstance(apart, dict) else "")


def side_by_side_rows(reports: list[dict]) -> tuple[list[str], list[list]]:
    """(the pretrained sources, one row per claim): the claim, then per source (verdict, its text: relation and
    layer shown, number, null, difference)."""
    pretrained = [r for r in reports if r.get("kind") != "synthetic"]
    blocks = [claims_block(r)["lines"] for r in pretrained]
    rows = []
    for index, claim in enumerate(line["claim"] for line in blocks[0]):
        cells = []
        for lines in blocks:
            line = lines[index]
            shown = ", ".join(filter(None, [line["relation"], None if line["layer"] is None else f"layer {line['layer']}"]))
            text = [f"{shown + ': ' if shown else ''}{_with_ci(line['metric'])}"] if line["metric"] else []
            if line["null_name"]:
                text.append(f"null {line['null_name']}: {_with_ci(line['null'])}")
            if line["difference"]:
                text.append(f"difference {_difference_text(line['difference'])}")
            cells.append((line["verdict"], text))
        rows.append([claim, *cells])
    return [source_name(r) for r in pretrained], rows


def summary_html(reports: list[dict], title: str) -> str:
    """``<section id="summary">``: the title, a line per stage a partial report lacks, a warning per difference in
    what compared reports measured, one line per claim (one report: number, null, difference, verdict and
    comparison; several: a column per pretrained source, the full lines folded below), then the rule."""
    parts = [f"<section id='summary'><h1>{html.escape(title)}</h1>"]
    partial = partial_lines(reports)
    if partial:
        parts.append("<div class='partial'><p><b>Partial report</b>: stages are missing (rerun with --resume to "
                     "finish them).</p><ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in partial) +
                     "</ul></div>")
    differences = measured_differences(reports)
    if differences:
        parts.append("<div class='differences'><p><b>These reports measured different things</b>; compare their "
                     "numbers with care:</p><ul>" + "".join(f"<li class='warn'>{html.escape(line)}</li>"
                                                            for line in differences) + "</ul></div>")
    parts.append("<h2>Summary: the paper's claims</h2>")
    pretrained = [r for r in reports if r.get("kind") != "synthetic"]
    if len(pretrained) > 1:
        sources, rows = side_by_side_rows(reports)
        paths = [_model_path(r) or source_name(r) for r in pretrained]
        head = "<th>claim</th>" + "".join(f"<th title='{html.escape(path)}'>{html.escape(name)}</th>"
                                          for name, path in zip(sources, paths))
        body = "".join("<tr><td>" + html.escape(row[0]) + "</td>" + "".join(
            f"<td class='verdict {verdict.replace(' ', '-')}'><b>{html.escape(verdict)}</b>" +
            "".join(f"<br>{html.escape(t)}" for t in text) + "</td>" for verdict, text in row[1:]) + "</tr>"
            for row in rows)
        parts.append(f"<table class='side-by-side'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    else:
        parts.append(summary_table_html(reports))
    parts.append(f"<p class='rule'>{html.escape(VERDICT_RULE)}</p></section>")
    if len(pretrained) > 1:
        full = summary_rows(reports)
        parts.append(f"<h2>The claims in full</h2><details><summary>{len(full)} lines (click to open)</summary>"
                     f"{summary_table_html(reports, 'full-measure')}</details>")
    return "".join(parts)


def figure_html(caption: str, uri: str, key: dict | None = None) -> str:
    """A figure of the page: its caption's first sentence as the heading, the rest as a paragraph, the image;
    ``key`` (:func:`llmprobe.report.figures.figure_key`: its panels and legend entries) as ``data-`` attributes."""
    title, _, rest = caption.partition(". ")          # a long caption: its first sentence heads the figure
    data = "".join(f" data-{name}='{html.escape(json.dumps(value))}'" for name, value in (key or {}).items())
    return (f"<figure{data}><h2>{html.escape(title)}</h2>" + (f"<p>{html.escape(rest)}</p>" if rest else "") +
            f"<img alt='{html.escape(title)}' src='{uri}'></figure>")


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee;margin:.5em 0}.err{color:#a00}figure{margin:0}
h1{font-size:1.6em}h2{font-size:1.2em;margin-top:1.6em}summary{cursor:pointer;color:#555}
.rule{font-size:12px;color:#555}.supported{background:#dff0d8}.not-shown{background:#f2dede}
.weak,.inconclusive{background:#fcf8e3}.not-measured,.null-not-measured,.not-comparable,.not-testable-here{color:#888}
.partial,.differences{border-left:4px solid #c90;background:#fff8e6;padding:.3em 1em;margin:1em 0}
.partial ul,.differences ul{margin:.3em 0}th[title]{text-decoration:underline dotted}
#summary .side-by-side td{vertical-align:top}
table.claims{width:100%}.claims td{vertical-align:top}.claims td.measure{cursor:help}
.claims sup a,.measures{color:#555}.claims sup a{text-decoration:none;margin-left:1px}
p.measures{font-size:12px;margin:.2em 0 0}ol.measures{font-size:12px;margin:.2em 0 1em;padding-left:2em}"""


def render_html(reports: list[dict], title: str, extra_images: list[tuple[str, str]] = ()) -> str:
    """A self-contained page, the answer first: the summary of the paper's claims (``<section id="summary">``),
    then the plots (per-depth curves with intervals and controls, the less central ones folded in ``<details>``)
    and any extra images, then the tables (long ones folded). No JavaScript.

    ``extra_images``: (caption, data URI or path to a PNG) pairs, e.g. synthetic capacity plots. Every user
    string is escaped.
    """
    rows = [row for report in reports for row in metric_rows(report)]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body>{summary_html(reports, title)}"]
    figures = [(caption, figure_html(caption, png_data_uri(figure), figure_key(figure)), folded)
               for caption, figure, folded in report_figures(reports)]
    parts += [page for _, page, folded in figures if not folded]
    folded = [(caption, page) for caption, page, fold in figures if fold]
    if folded:
        parts.append(f"<h2>{len(folded)} more figures</h2><details><summary>{html.escape(', '.join(c for c, _ in folded))}"
                     f" (click to open)</summary>{''.join(page for _, page in folded)}</details>")
    for caption, image in extra_images:
        if not image.startswith("data:"):
            path = Path(image)
            if not path.is_file():
                continue
            image = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(figure_html(caption, image))
    for caption, header, body in summary_tables(reports, rows):
        table = _table_html(header, body)
        if len(body) > LONG_TABLE:
            table = f"<details><summary>{len(body)} rows (click to open)</summary>{table}</details>"
        parts.append(f"<h2>{html.escape(caption)}</h2>{table}")
    errors = [e for report in reports for e in report.get("errors", [])]
    if errors:
        items = "".join(f"<li class='err'>{html.escape(str(e))}</li>" for e in errors)
        parts.append(f"<h2>Errors and skipped facts</h2><details><summary>{len(errors)} message{'s' if len(errors) != 1 else ''}</summary>"
                     f"<ul>{items}</ul></details>")
    parts.append("</body></html>")
    return "".join(parts)


def render_markdown(reports: list[dict], title: str) -> str:
    """The Markdown report, the answer first: the missing stages of a partial report, the differences in what
    compared reports measured, the summary of the claims (a column per source when there are several) with the
    verdict rule, then the tables."""
    rows = [row for report in reports for row in metric_rows(report)]
    parts = [f"# {_md(title)}"]
    partial = partial_lines(reports)
    if partial:
        parts.append("**Partial report**: stages are missing (rerun with --resume to finish them).\n\n" +
                     "\n".join(f"- {_md(line)}" for line in partial))
    differences = measured_differences(reports)
    if differences:
        parts.append("**These reports measured different things**; compare their numbers with care:\n\n" +
                     "\n".join(f"- {_md(line)}" for line in differences))
    if len([r for r in reports if r.get("kind") != "synthetic"]) > 1:
        sources, side = side_by_side_rows(reports)
        summary = _table_md(["claim", *sources], [[row[0], *(f"{verdict}: {'; '.join(text)}" if text else verdict
                                                            for verdict, text in row[1:])] for row in side])
    else:
        full = summary_rows(reports)
        summary = _table_md(SUMMARY_HEADER, full) if full else "No pretrained report: no claim is measured here."
    parts.append(f"## Summary: the paper's claims\n\n{summary}\n\n{_md(VERDICT_RULE)}")
    for caption, header, body in summary_tables(reports, rows):
        parts.append(f"## {_md(caption)}\n\n{_table_md(header, body)}")
    errors = [e for report in reports for e in report.get("errors", [])]
    if errors:
        parts.append("## Errors and skipped facts\n\n" + "\n".join(f"- {_md(e)}" for e in errors))
    return "\n\n".join(parts) + "\n"


def export(report_dir: str | Path, formats: tuple[str, ...] = ("html", "md", "csv"), out: str | Path | None = None,
           extra_images: list[tuple[str, str]] = (), overwrite: bool = False) -> list[Path]:
    """Write report.html / report.md / metrics.csv for the report in ``report_dir`` (into ``out`` or beside it).
    An ``out`` holding another run (its report.json) is refused (UsageError) unless ``overwrite``, which first
    deletes that run's files (:func:`_check_no_other_run`); the files written are added to ``out``'s manifest.json
    (``llmprobe.io.note_written``)."""
    report = read_report(report_dir)
    folder = Path(out or report_dir)
    own = _check_no_other_run(folder, [report], overwrite)
    written = write_all(with_matched([report]), folder, f"llmprobe report: {source_name(report)}", formats,
                        extra_images)
    note_written(folder, written, **({} if own else {"command": "report", "sources": [str(report_dir)]}))
    return written


def _check_no_other_run(out: Path, reports: list[dict], overwrite: bool = False) -> bool:
    """True when ``out`` is the folder of one of ``reports``; UsageError when it holds another run's report.json
    (its report.html, report.md and metrics.csv would be replaced beside it), else False. With ``overwrite`` that
    run is replaced instead: the files its manifest.json names and llmprobe writes are deleted
    (``llmprobe.io.remove_outputs``; any other file stays) with the manifest, which the files written then start
    again; a report.json the manifest does not name (or a manifest.json llmprobe did not write) is still refused."""
    held = out / "report.json"
    if not held.is_file():
        return False
    if any(held.resolve() == (Path(r["_path"]) / "report.json").resolve() for r in reports if r.get("_path")):
        return True
    if not overwrite:
        raise UsageError(f"--out {out} holds another run ({held}): its report.html, report.md and metrics.csv would "
                         f"be replaced beside it; give another --out (llmprobe report {out} exports that run), or "
                         f"--overwrite to replace that run")
    manifest = read_manifest(out)
    if not manifest or "report.json" not in manifest["files"]:
        raise UsageError(f"--out {out} holds another run ({held}) that its {MANIFEST} does not name as llmprobe's "
                         f"(--overwrite replaces only the files llmprobe wrote there); remove it, or give another "
                         f"--out")
    remove_outputs(out, manifest)
    (out / MANIFEST).unlink()
    return False


def all_facts_block(report: dict) -> dict | None:
    """The report's all-facts control shown apart (``matched.all_facts``), or None."""
    block = report.get("matched")
    apart = block.get("all_facts") if isinstance(block, dict) else None
    return apart if isinstance(apart, dict) else None


def with_matched(reports: list[dict]) -> list[dict]:
    """The reports followed by the matched synthetic controls inside them (each trained point a source of its own,
    see :func:`matched_sources`; ``_owner``: the report it belongs to): the graded control's, then the all-facts
    control's shown apart (labelled "synthetic all-facts ...")."""
    return list(reports) + [dict(c, _path=r.get("_path"), _owner=r) for r in reports
                            for c in matched_sources(r.get("matched"), r["schema_version"])
                            + matched_sources(all_facts_block(r), r["schema_version"], "synthetic all-facts")]


def label_apart(reports: list[dict]) -> list[dict]:
    """Sources that share a name (two runs of one model, or their controls) get the report folder's name after
    it (and a number where the folder names repeat too), so their rows and plot lines stay apart. With several
    pretrained reports, each matched control is named after its report first (``llama: synthetic ...``)."""
    pretrained = [r for r in reports if r.get("kind") != "synthetic"]
    _apart(pretrained)
    if len(pretrained) > 1:
        for report in reports:
            if report.get("kind") == "synthetic" and report.get("_owner") is not None:
                report["_label"] = f"{source_name(report['_owner'])}: {report.get('label') or 'synthetic'}"
    _apart(reports)
    return reports


def _apart(reports: list[dict]) -> None:
    groups: dict[str, list[dict]] = {}
    for report in reports:
        groups.setdefault(source_name(report), []).append(report)
    for name, group in groups.items():
        if len(group) < 2:
            continue
        folders = [Path(r.get("_path") or "").name or "?" for r in group]
        for index, (report, folder) in enumerate(zip(group, folders), 1):
            report["_label"] = f"{name} ({folder})" if folders.count(folder) == 1 else f"{name} ({folder} #{index})"


def compare(report_dirs: list[str | Path], out: str | Path, formats: tuple[str, ...] = ("html", "md", "csv"),
            overwrite: bool = False) -> list[Path]:
    """Side-by-side page of any number of reports, aligned on relations and normalised depth: the claims a column
    per report, a warning per difference in what they measured; titled by the pretrained models' short names.
    An ``out`` holding a run (its report.json) is refused unless ``overwrite`` (as :func:`export`)."""
    if len(report_dirs) < 1:
        raise ValueError("compare needs at least one report directory")
    reports = label_apart(with_matched([read_report(d) for d in report_dirs]))
    pretrained = [source_name(r) for r in reports if r.get("kind") != "synthetic"]
    n_controls = len(reports) - len(pretrained)
    title = f"llmprobe comparison: {' vs '.join(pretrained) or 'synthetic sources'}" + (
        f" (and {n_controls} matched synthetic control{'s' if n_controls > 1 else ''})" if n_controls and pretrained
        else "")
    out = Path(out)
    if overwrite and any(out.resolve() == Path(d).resolve() for d in report_dirs):
        raise UsageError(f"compare: --out {out} is one of the compared folders: --overwrite would delete the run it "
                         f"compares; give another folder")
    _check_no_other_run(out, [], overwrite)
    written = write_all(reports, out, title, formats)
    note_written(out, written, command="compare", sources=[str(d) for d in report_dirs])
    return written


def write_all(reports: list[dict], out: Path, title: str, formats: tuple[str, ...],
              extra_images: list[tuple[str, str]] = ()) -> list[Path]:
    formats = report_formats(formats)         # UsageError (a ValueError) naming an unknown one
    rows = [row for report in reports for row in metric_rows(report)]
    claims = [row for report in reports for row in claim_rows(report)]
    written = []
    if "html" in formats:
        written.append(write_text(out / REPORT_FILES["html"], visible(render_html(reports, title, extra_images))))
    if "md" in formats:
        written.append(write_text(out / REPORT_FILES["md"], visible(render_markdown(reports, title))))
    if "csv" in formats:
        written.append(write_csv(rows + claims, out / REPORT_FILES["csv"]))
    if "json" in formats:
        written.append(write_json(out / REPORT_FILES["json"], rows + claims))
    return written

