"""Relation datasets: facts, relations, loaders and the shared-subject fact table.

Formats read by :func:`load_relations` (see ``prompts/SCHEMA.md``):

* our JSON schema (``{"name", "templates", "neutral_templates", "properties", "facts": [{"subject", "object"}]}``),
* the LRE relations format (``{"name", "prompt_templates": ["... {} ..."], "samples": [{"subject", "object"}]}``),
* CSV and JSON-lines files with subject/object columns (and an optional template column),
* anything ``datasets.load_dataset`` reads, as ``hf:NAME[:split]``, and a ``datasets.Dataset`` or
  ``pandas.DataFrame`` given as it is (the same column rules as a CSV file);
* the bundled LRE dataset (``prompts/lre/``, 47 relations, MIT; ``prompts/lre/source.json`` says where from) as
  ``lre:factual``, ``lre:linguistic``, ``lre:commonsense``, ``lre:bias``, ``lre:all`` or ``lre:NAME``, NAME a
  relation's name in snake_case (``lre:univ_degree_gender``; also as the file writes it, ``lre:univ degree
  gender``, or the file's name, ``lre:degree_gender``): the relation is named in snake_case (every LRE-format
  relation is; the file's name is kept in ``properties.lre_name``), with
  every row as the file has it, duplicates kept (the LRE reference's protocol uses them; the strict protocol
  counts a repeated fact once), literal ``\\uXXXX`` escapes in subjects and objects read as the characters they
  name ("Bras\\u00edlia" is "Brasília") and spaces around them dropped. The reference keeps both: its
  ``json.load`` leaves the file's doubly escaped ``\\\\u00ed`` as six characters (2 rows of
  country_capital_city) and 3 rows end in a space; ``lre:SPEC:literal`` (e.g. ``lre:all:literal``) reads every
  row as the reference does, and :func:`lre_as_read` turns a loaded relation's facts into that text.

Malformed input raises :class:`DatasetError`, whose message names the file and the field.
"""
from __future__ import annotations

import csv
import difflib
import functools
import hashlib
import itertools
import json
import numbers
import os
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from llmprobe.checks import parse_json, special_file
from llmprobe.io import write_text

if TYPE_CHECKING:
    import torch

__all__ = ["DatasetError", "Fact", "Relation", "FactTable", "load_relations", "list_bundled", "save_relation",
           "relation_from_dict", "format_relation", "infer_cardinality", "snake_name", "lre_source", "SLOT",
           "CARDINALITIES"]

SLOT = "{}"
CARDINALITIES = ("one-to-one", "many-to-one", "one-to-many", "many-to-many")
DEFAULT_NEUTRAL = ["{}"]
TOO_DEEP = "a relation is at most a list of objects holding lists of facts: a few levels deep"
_PACKAGE = "prompts"
MAX_JSON_BYTES = 256 << 20      # a .json relation file is read whole: at most this size (rows files stream)
NULL_TEXTS = ("", "none", "null", "nan")       # a missing value written as text: never a relation name
LRE_CATEGORIES = ("factual", "linguistic", "commonsense", "bias")     # the folders of prompts/lre/
LRE_SOURCE = "source.json"      # prompts/lre/'s metadata: upstream URL, commit (or why none), licence


class DatasetError(ValueError):
    """A relation file or dataset is malformed or cannot be found; the message names the file and the field."""


@dataclass(frozen=True)
class Fact:
    subject: str
    object: str


@dataclass
class Relation:
    """One relation: prompt templates with a ``{}`` subject slot, relation-free templates, facts, properties."""

    name: str
    templates: list[str]
    neutral_templates: list[str]
    facts: list[Fact]
    properties: dict = field(default_factory=dict)
    source: str = ""

    @property
    def subjects(self) -> list[str]:
        return [f.subject for f in self.facts]

    @property
    def objects(self) -> list[str]:
        return [f.object for f in self.facts]

    def to_dict(self) -> dict:
        """Our JSON schema (``source`` is not stored: it is where the relation was read from)."""
        return {"name": self.name, "templates": list(self.templates),
                "neutral_templates": list(self.neutral_templates), "properties": dict(self.properties),
                "facts": [{"subject": f.subject, "object": f.object} for f in self.facts]}

    def with_facts(self, facts: list[Fact]) -> Relation:
        """This relation with other facts (templates, properties and source shared, not copied)."""
        return Relation(self.name, self.templates, self.neutral_templates, list(facts), self.properties, self.source)

    def __repr__(self) -> str:
        return (f"Relation({self.name!r}, {len(self.facts)} facts, {len(self.templates)} templates, "
                f"{self.properties.get('cardinality', 'cardinality not given')})")


@dataclass
class FactTable:
    """Many relations over one shared subject set; ``table[s, r]`` indexes ``attributes[r]``, -1 = no fact."""

    subjects: list[str]
    relations: list[str]
    attributes: list[list[str]]
    table: torch.Tensor

    @classmethod
    def from_relations(cls, relations: list[Relation], min_relations: int = 1) -> "FactTable":
        """Subjects that have facts in at least ``min_relations`` of the relations, in first-seen order.

        Attributes of a relation are its distinct objects among the kept subjects, in first-seen order. When a
        subject has several objects in one relation, its first fact is used.
        """
        names = [r.name for r in relations]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise DatasetError(f"duplicate relation names: {dup}")
        per_rel: list[dict[str, str]] = []
        count: dict[str, int] = {}
        for rel in relations:
            first: dict[str, str] = {}
            for f in rel.facts:
                first.setdefault(f.subject, f.object)
            per_rel.append(first)
            for s in first:
                count[s] = count.get(s, 0) + 1
        subjects = [s for s, c in count.items() if c >= min_relations]
        import torch  # lazy: relations are read without torch (llmprobe --help names them)

        table = torch.full((len(subjects), len(relations)), -1, dtype=torch.long)
        attributes: list[list[str]] = []
        for r, first in enumerate(per_rel):
            index: dict[str, int] = {}
            for i, s in enumerate(subjects):
                if s in first:
                    table[i, r] = index.setdefault(first[s], len(index))
            attributes.append(list(index))
        return cls(subjects, names, attributes, table)

    def __repr__(self) -> str:
        known = int((self.table >= 0).sum())
        return (f"FactTable({len(self.subjects)} subjects x {len(self.relations)} relations, {known} facts, "
                f"attributes per relation {[len(a) for a in self.attributes]})")


# ----------------------------------------------------------------------------------------------- validation

def _err(source: str, fld: str, problem: str) -> DatasetError:
    return DatasetError(f"{source}: field '{fld}' {problem}")


def _string(value, source: str, fld: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _err(source, fld, f"must be a non-empty string, got {value!r}"[:300])
    _encodable(value, source, fld)
    return value.strip()


def _encodable(value: str, source: str, fld: str) -> None:
    """A DatasetError naming the field when ``value`` holds a lone surrogate (a JSON ``\\ud800`` escape without
    its pair), which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _err(source, fld, f"holds a lone surrogate {value[error.start]!r} at character {error.start} (a "
                                f"\\uD800-\\uDFFF escape without its pair), which is no character: fix the "
                                f"text in {value!r}"[:400]) from None


def _relation_name(value, source: str, fld: str) -> str:
    """A relation column's value as a relation name: a non-empty string (or a whole number), not a missing
    value written as text (``None``, ``nan``) nor a list; DatasetError naming the file and row otherwise."""
    text = str(value).strip() if type(value) is int else value.strip() if isinstance(value, str) else None
    if text is None or text.lower() in NULL_TEXTS or text[:1] + text[-1:] in ("[]", "{}", "()"):
        raise _err(source, fld, f"must name the row's relation (a non-empty string), got {value!r}"[:200] +
                   "; give every row a relation name, or drop the relation column to name the relation after the "
                   "file")
    _encodable(text, source, fld)
    return text


def _templates(value, source: str, fld: str, required: bool) -> list[str]:
    if value is None and not required:
        return list(DEFAULT_NEUTRAL)
    if not isinstance(value, list) or not value:
        raise _err(source, fld, f"must be a non-empty list of strings with a '{{}}' slot, got {value!r}")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, str) or t.count(SLOT) != 1:
            raise _err(source, f"{fld}[{i}]", f"must be a string with exactly one '{{}}' subject slot, got {t!r}")
        _encodable(t, source, f"{fld}[{i}]")
        if t not in out:
            out.append(t)
    return out


def infer_cardinality(facts: list[Fact]) -> str:
    """'one-to-one', 'many-to-one', 'one-to-many' or 'many-to-many' from the facts themselves."""
    by_subject: dict[str, set] = {}
    by_object: dict[str, set] = {}
    for f in facts:
        by_subject.setdefault(f.subject, set()).add(f.object)
        by_object.setdefault(f.object, set()).add(f.subject)
    functional = all(len(v) == 1 for v in by_subject.values())
    injective = all(len(v) == 1 for v in by_object.values())
    return {(True, True): "one-to-one", (True, False): "many-to-one",
            (False, True): "one-to-many", (False, False): "many-to-many"}[(functional, injective)]


def _check_facts(facts: list[Fact], properties: dict, source: str, fld: str = "facts") -> list[Fact]:
    """Drop exact duplicates; a relation declared one-to-one or many-to-one must give each subject one object."""
    if not facts:
        raise _err(source, fld, "is empty: a relation needs at least one fact")
    card = properties.get("cardinality")
    if card is not None and card not in CARDINALITIES:
        raise _err(source, "properties.cardinality", f"must be one of {list(CARDINALITIES)}, got {card!r}")
    seen: dict[str, tuple[int, str]] = {}
    out, pairs = [], set()
    for i, f in enumerate(facts):
        if (f.subject, f.object) in pairs:
            continue
        pairs.add((f.subject, f.object))
        if card in ("one-to-one", "many-to-one") and f.subject in seen:
            j, obj = seen[f.subject]
            raise _err(source, f"{fld}[{i}].object",
                       f"gives subject {f.subject!r} the object {f.object!r}, but {fld}[{j}] gives {obj!r} "
                       f"and the relation is declared {card}")
        seen.setdefault(f.subject, (i, f.object))
        out.append(f)
    return out


def relation_from_dict(data, source: str = "<dict>") -> Relation:
    """Parse one relation in our schema or in the LRE format (detected by ``samples``/``prompt_templates``)."""
    if not isinstance(data, dict):
        raise DatasetError(f"{source}: expected a JSON object with a relation, got {type(data).__name__}")
    if "facts" not in data and ("samples" in data or "prompt_templates" in data):
        return _from_lre(data, source)
    name = _string(data.get("name"), source, "name")
    templates = _templates(data.get("templates"), source, "templates", required=True)
    neutral = _templates(data.get("neutral_templates"), source, "neutral_templates", required=False)
    props = data.get("properties", {})
    if not isinstance(props, dict):
        raise _err(source, "properties", f"must be an object, got {props!r}")
    facts = _fact_list(data.get("facts"), source, "facts")
    facts = _check_facts(facts, props, source)
    props = dict(props)
    props.setdefault("cardinality", infer_cardinality(facts))
    return Relation(name, templates, neutral, facts, props, source)


def _fact_list(value, source: str, fld: str) -> list[Fact]:
    if not isinstance(value, list) or not value:
        raise _err(source, fld, f"must be a non-empty list of {{'subject', 'object'}} objects, got {value!r}"[:300])
    facts = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _err(source, f"{fld}[{i}]", f"must be an object with 'subject' and 'object', got {item!r}")
        facts.append(Fact(_string(item.get("subject"), source, f"{fld}[{i}].subject"),
                          _string(item.get("object"), source, f"{fld}[{i}].object")))
    return facts


_LRE_FN_TYPES = {"ONE_TO_ONE": "one-to-one", "MANY_TO_ONE": "many-to-one", "ONE_TO_MANY": "one-to-many",
                 "MANY_TO_MANY": "many-to-many"}


def snake_name(text: str) -> str:
    """An LRE relation's name as llmprobe names relations: lower case, each run of other characters one ``_``
    (``"univ degree gender"`` -> ``"univ_degree_gender"``, ``"company CEO"`` -> ``"company_ceo"``); quotes around
    it are dropped."""
    return re.sub(r"[\W_]+", "_", text.strip().strip("\"'").lower()).strip("_")


def _from_lre(data: dict, source: str) -> Relation:
    """The LRE (Hernandez et al. 2023) relation format; ``prompt_templates_zs`` are appended to the templates. The
    name is written in snake_case (:func:`snake_name`), the file's kept in ``properties.lre_name``."""
    lre_name = _string(data.get("name"), source, "name")
    name = snake_name(lre_name)
    if not name:
        raise _err(source, "name", f"must hold a letter or digit, got {lre_name!r}")
    templates = _templates(data.get("prompt_templates"), source, "prompt_templates", required=True)
    if data.get("prompt_templates_zs") is not None:
        for t in _templates(data["prompt_templates_zs"], source, "prompt_templates_zs", required=True):
            if t not in templates:
                templates.append(t)
    lre_props = data.get("properties") or {}
    if not isinstance(lre_props, dict):
        raise _err(source, "properties", f"must be an object, got {lre_props!r}")
    props = {"format": "lre", "lre_name": lre_name, **lre_props}
    fn_type = lre_props.get("fn_type")
    if fn_type in _LRE_FN_TYPES:
        props["cardinality"] = _LRE_FN_TYPES[fn_type]
    if "domain_name" in lre_props:
        props.setdefault("subject_type", lre_props["domain_name"])
    if "range_name" in lre_props:
        props.setdefault("object_type", lre_props["range_name"])
    facts = _check_facts(_fact_list(data.get("samples"), source, "samples"), props, source, "samples")
    props.setdefault("cardinality", infer_cardinality(facts))
    return Relation(name, templates, list(DEFAULT_NEUTRAL), facts, props, source)


# ------------------------------------------------------------------------------------------- row formats

def _get(row: dict, column: str):
    """``row[column]``; a dotted name walks nested dicts (``requested_rewrite.target_true.str``)."""
    if column in row:
        return row[column]
    value = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _whole_number_as_text(value):
    """A whole number (a year in a numeric column of a data frame or dataset) as the text a CSV file gives;
    any other value as it is."""
    return str(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def _from_rows(rows, source: str, name: str | None, columns: list[str], *, subject_column: str, object_column: str,
               template_column: str | None, relation_column: str | None, templates: list[str] | None,
               neutral_templates: list[str] | None, max_facts: int | None = None) -> list[Relation]:
    """Relations from table rows (CSV, JSON lines, Hugging Face datasets; any iterable, read once); one per value
    of ``relation_column``, or else one named ``name`` (None: a DatasetError asking for one). ``max_facts``: each
    relation keeps its first that many distinct facts, and without a relation column the rows are read only until
    it has them."""

    def has(col):
        return col in columns or ("." in col and col.split(".")[0] in columns)

    for col, keyword in ((subject_column, "subject_column"), (object_column, "object_column")):
        if not has(col):
            raise _err(source, col, f"is not a column (columns: {columns}); name the column that holds the "
                                    f"{keyword.split('_')[0]}s with {keyword}=")
    use_template = template_column if (template_column and has(template_column)) else None
    use_relation = relation_column if (relation_column and has(relation_column)) else None
    if not use_relation and not name:
        raise DatasetError(f"{source}: no relation column {relation_column!r} (columns: {columns}) and no name for "
                           f"its one relation: give relation='NAME' (or relation_column= naming the column that "
                           f"holds each row's relation)")
    groups: dict[str, dict] = {}
    for i, row in enumerate(rows):
        where = f"rows[{i}]"
        rel = _relation_name(_get(row, use_relation), source, f"{where}.{use_relation}") if use_relation else name
        g = groups.setdefault(rel, {"facts": [], "templates": [], "seen": set()})
        if max_facts is not None and len(g["seen"]) >= max_facts:
            if not use_relation:
                break                   # the one relation has its facts: the rest of the file is not read
            continue
        s = _whole_number_as_text(_get(row, subject_column))
        o = _whole_number_as_text(_get(row, object_column))
        fact = Fact(_string(s, source, f"{where}.{subject_column}"), _string(o, source, f"{where}.{object_column}"))
        g["facts"].append(fact)
        g["seen"].add(fact)
        if use_template and templates is None:
            t = _get(row, use_template)
            if t is not None and str(t).strip():
                t = _templates([str(t)], source, f"{where}.{use_template}", required=True)[0]
                if t not in g["templates"]:
                    g["templates"].append(t)
    if not groups:
        raise _err(source, "rows", "is empty: a relation needs at least one fact")
    out = []
    for rel, g in groups.items():
        if templates is not None:
            tpl = _templates(list(templates), source, "templates (argument)", required=True)
        elif g["templates"]:
            tpl = g["templates"]
        else:
            raise _err(source, template_column or "template",
                       "is missing: give a template column or templates=[...] with a '{}' slot")
        neutral = _templates(list(neutral_templates), source, "neutral_templates (argument)", required=True) \
            if neutral_templates is not None else list(DEFAULT_NEUTRAL)
        facts = _check_facts(g["facts"], {}, source, "rows")
        props = {"cardinality": infer_cardinality(facts), "format": "rows"}
        out.append(Relation(rel, tpl, neutral, facts, props, source))
    return out


def _read_text(path: Path) -> str:
    """A file's text as UTF-8 (a leading byte-order mark is dropped), or a DatasetError naming the file."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DatasetError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); relation files "
                           f"must be UTF-8: re-save it as UTF-8 (it may be Latin-1 or Windows-1252)") from None


def _lines(path: Path):
    """The file's lines as UTF-8 text (line endings kept, a leading byte-order mark dropped), read one at a time
    (a rows file is never held whole); a DatasetError naming the file and line for bytes that are not UTF-8."""
    with open(path, "rb") as handle:
        for n, raw in enumerate(handle, 1):
            try:
                yield raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} on line {n}); relation files "
                                   f"must be UTF-8: re-save it as UTF-8 (it may be Latin-1 or Windows-1252)") from None


def _read_csv(path: Path, relation: str | None, **kw) -> list[Relation]:
    reader = csv.DictReader(_lines(path))
    columns = [c.strip() for c in (reader.fieldnames or [])]
    rows = ({(k or "").strip(): v for k, v in r.items()} for r in reader)
    return _from_rows(rows, str(path), relation or path.stem, columns, **kw)


def _read_jsonl(path: Path, relation: str | None, **kw) -> list[Relation]:
    """JSON lines, parsed as they are read (up to ``max_facts``: :func:`_from_rows`); the columns are the first
    row's keys."""
    def parsed():
        i = 0
        for n, line in enumerate(_lines(path), 1):
            if line.strip():
                row = parse_json(line, f"{path}: line {n}", DatasetError, f" ({TOO_DEEP})")
                if not isinstance(row, dict):
                    raise _err(str(path), f"rows[{i}]", f"must be a JSON object (line {n})")
                i += 1
                yield row

    rows = parsed()
    first = next(rows, None)
    if first is None:
        raise _err(str(path), "rows", "is empty: a relation needs at least one fact")
    return _from_rows(itertools.chain([first], rows), str(path), relation or path.stem, sorted(first), **kw)


PACKAGED_BUILDERS = ("json", "csv", "parquet", "arrow", "text")   # datasets' loaders of local files: no name


def _read_hf(spec: str, hf_kwargs: dict | None, relation: str | None, **kw) -> list[Relation]:
    """``hf:NAME[:split]`` through ``datasets.load_dataset(NAME, split=..., **hf_kwargs)``."""
    rest = spec[3:]
    name, _, split = rest.rpartition(":") if ":" in rest else (rest, "", "")
    if not name:
        raise DatasetError(f"{spec}: expected hf:NAME[:split]")
    import datasets as hf_datasets  # lazy: start-up time: Hugging Face datasets only for hf: sources

    try:
        ds = hf_datasets.load_dataset(name, split=split or None, **(hf_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - report any loader failure as a dataset error
        raise DatasetError(f"{spec}: datasets.load_dataset({name!r}) failed: {type(e).__name__}: {e}") from e
    if isinstance(ds, hf_datasets.DatasetDict):
        if "train" in ds:
            ds = ds["train"]
        elif len(ds) == 1:
            ds = next(iter(ds.values()))
        else:
            raise DatasetError(f"{spec}: several splits {list(ds)}; name one as hf:{name}:SPLIT")
    base = os.path.basename(name.rstrip("/")) or name
    files = (hf_kwargs or {}).get("data_files")
    if isinstance(files, (str, os.PathLike)) and base in PACKAGED_BUILDERS:
        base = Path(files).stem  # a packaged builder: name the relation after its file
    return _from_rows(ds, spec, relation or base, list(ds.column_names), **kw)


def _table_kind(item) -> str | None:
    """``"datasets.Dataset"``, ``"datasets.DatasetDict"`` or ``"pandas.DataFrame"`` for a table given as an
    object, else None (a table's library is imported when it is one: only loaded libraries are asked)."""
    hf, pandas = sys.modules.get("datasets"), sys.modules.get("pandas")
    if hf is not None and isinstance(item, hf.DatasetDict):
        return "datasets.DatasetDict"
    if hf is not None and isinstance(item, hf.Dataset):
        return "datasets.Dataset"
    if pandas is not None and isinstance(item, pandas.DataFrame):
        return "pandas.DataFrame"
    return None


def _read_table(item, kind: str, index: int, relation: str | None, **kw) -> list[Relation]:
    """The relations of a ``datasets.Dataset`` or ``pandas.DataFrame`` (``kind``), the ``index``-th item of
    ``load_relations``: its rows read as a CSV file's; the relation is named ``relation``, or a Dataset's hub name
    (``info.dataset_name``, not a packaged builder's), when there is no relation column."""
    source = f"{kind} (item {index} of load_relations)"
    if kind == "datasets.DatasetDict":
        raise DatasetError(f"{source}: a DatasetDict holds several splits {list(item)}; pass one split, e.g. "
                           f"dataset[{next(iter(item), 'train')!r}]")
    if kind == "datasets.Dataset":
        hub_name = item.info.dataset_name if item.info.dataset_name not in PACKAGED_BUILDERS else None
        return _from_rows(item, source, relation or hub_name, list(item.column_names), **kw)
    columns = [str(column) for column in item.columns]
    rows = (dict(zip(columns, values)) for values in item.itertuples(index=False, name=None))
    return _from_rows(rows, source, relation, columns, **kw)


# ------------------------------------------------------------------------------------------------ loading

def _bundled_files() -> dict[str, object]:
    root = resources.files(_PACKAGE)
    return {p.name[:-5]: p for p in root.iterdir() if p.name.endswith(".json") and p.is_file()}


def list_bundled(include_lre: bool = False) -> list[str]:
    """Names of the relations shipped in ``prompts/`` (what ``load_relations(None)`` loads); ``include_lre``:
    then the 47 of the bundled LRE dataset as ``lre:NAME`` (also loaded whole as ``lre:all`` or by category,
    ``lre:factual``, ...)."""
    return sorted(_bundled_files()) + (sorted(f"lre:{name}" for name in _lre_catalogue()[1]) if include_lre else [])


def _close_names(text: str) -> list[str]:
    """Up to three bundled or ``lre:`` relation names like ``text`` (difflib's ratio at least 0.6), best first."""
    key = snake_name(text[len("lre:"):] if text.startswith("lre:") else text)
    candidates = [(name, name) for name in _bundled_files()] + [(name, f"lre:{name}") for name in _lre_catalogue()[1]]
    scored = sorted((-difflib.SequenceMatcher(None, key, name).ratio(), shown) for name, shown in candidates)
    return [shown for score, shown in scored[:3] if -score >= 0.6]


def _did_you_mean(text: str) -> str:
    close = _close_names(text)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _read_json_text(text: str, source: str) -> list[Relation]:
    data = parse_json(text, source, DatasetError, f" ({TOO_DEEP})")
    if isinstance(data, list):
        if not data:
            raise DatasetError(f"{source}: empty list, expected relations")
        return [relation_from_dict(d, f"{source}[{i}]") for i, d in enumerate(data)]
    return [relation_from_dict(data, source)]


def _read_path(path: Path, row_kw: dict, relation: str | None) -> list[Relation]:
    """One relation file; a FIFO, device or socket is refused unopened, a .json file over ``MAX_JSON_BYTES``
    unread."""
    kind = special_file(path)
    if kind:
        raise DatasetError(f"{path} is {kind}, not a relation file; refused (reading it could wait for ever): give "
                           f"a regular .json, .jsonl or .csv file")
    suffix = path.suffix.lower()
    if suffix == ".json":
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise DatasetError(f"{path}: {size:,} bytes ({size / 2 ** 20:.0f} MiB); a .json relation file is read "
                               f"whole, so it may hold at most {MAX_JSON_BYTES >> 20} MiB: write the facts as JSON "
                               f"lines (.jsonl) or CSV, which are read row by row and only up to --max-facts")
        return _read_json_text(_read_text(path), str(path))
    if suffix == ".csv":
        return _read_csv(path, relation, **row_kw)
    if suffix == ".jsonl":
        return _read_jsonl(path, relation, **row_kw)
    raise DatasetError(f"{path}: unknown file type {suffix!r} (expected .json, .jsonl or .csv)")


@functools.lru_cache(maxsize=1)
def _lre_catalogue() -> tuple[dict, dict, dict]:
    """The bundled LRE files, read once: (category -> its files in name order, relation name in snake_case ->
    file, file name without .json -> file)."""
    root = resources.files(_PACKAGE) / "lre"
    by_category = {c: sorted((p for p in (root / c).iterdir() if p.name.endswith(".json")), key=lambda p: p.name)
                   for c in LRE_CATEGORIES}
    by_name, by_file = {}, {}
    for res in itertools.chain.from_iterable(by_category.values()):
        data = parse_json(res.read_text(encoding="utf-8"), str(res), DatasetError, f" ({TOO_DEEP})")
        by_name[snake_name(_string(data.get("name") if isinstance(data, dict) else None, str(res), "name"))] = res
        by_file[res.name[:-5]] = res
    return by_category, by_name, by_file


@functools.lru_cache(maxsize=1)
def lre_source() -> dict:
    """``prompts/lre/source.json``: where the bundled LRE files come from (``url``, ``path``, ``commit`` or why
    it is not known, the date ``copied``), their ``licence`` and ``copyright``, and the ``sha256`` of the files
    (:func:`lre_files_sha256`)."""
    res = resources.files(_PACKAGE) / "lre" / LRE_SOURCE
    return parse_json(res.read_text(encoding="utf-8"), str(res), DatasetError)


def lre_files_sha256() -> str:
    """sha256 of the bundled LRE files: each file's ``CATEGORY/NAME.json``, a NUL byte and its bytes, in category
    and name order (``source.json`` records it, so a changed copy shows)."""
    digest = hashlib.sha256()
    for category, files in _lre_catalogue()[0].items():
        for res in files:
            digest.update(f"{category}/{res.name}".encode() + b"\0" + res.read_bytes())
    return digest.hexdigest()


def _lre_files(spec: str) -> list:
    """The bundled LRE files an ``lre:`` name stands for (module doc), in category and file order: ``all``, a
    category, a relation's name in snake_case or as the file writes it (quotes around it dropped), or a file's
    name."""
    by_category, by_name, by_file = _lre_catalogue()
    key = snake_name(spec[len("lre:"):])
    if key == "all":
        return list(itertools.chain.from_iterable(by_category.values()))
    if key in by_category:
        return by_category[key]
    if key in by_name or key in by_file:
        return [by_name.get(key) or by_file[key]]
    raise DatasetError(f"{spec!r} is not an LRE category or relation{_did_you_mean(spec)}: lre:all, "
                       f"{', '.join('lre:' + c for c in LRE_CATEGORIES)}, or lre:NAME with NAME one of "
                       f"{', '.join(sorted(by_name))}")


def _unescape(text: str) -> str:
    """Literal ``\\uXXXX`` escapes (the LRE files hold a few) as the characters they name."""
    return re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), text)


LITERAL = ":literal"      # lre:SPEC:literal: the rows' text as the reference reads it (module doc)


def _read_lre(spec: str) -> list[Relation]:
    """The relations of an ``lre:`` name: each file checked as any LRE-format file, then its rows as they are
    (duplicates kept, escapes read and spaces stripped, or with ``:literal`` the text as the reference's
    ``json.load`` gives it: module doc); ``properties.rows`` / ``duplicate_rows`` count them, ``as_read`` maps
    each read text that differs from the file's to the file's (:func:`lre_as_read`)."""
    literal = spec.endswith(LITERAL)
    meta = lre_source()
    commit = f"commit {meta['commit']}" if meta.get("commit") else f"copied {meta['copied']}, upstream commit not " \
                                                                      f"recorded"
    out = []
    for res in _lre_files(spec[:-len(LITERAL)] if literal else spec):
        text = res.read_text(encoding="utf-8")
        relation = _read_json_text(text, str(res))[0]
        rows = [(row["subject"], row["object"]) for row in json.loads(text)["samples"]]
        as_read = {_unescape(t.strip()): t for row in rows for t in row if _unescape(t.strip()) != t}
        facts = [Fact(*row) if literal else Fact(*(_unescape(t.strip()) for t in row)) for row in rows]
        category = next(c for c, files in _lre_catalogue()[0].items() if res in files)
        properties = {**relation.properties, "rows": len(facts), "duplicate_rows": len(facts) - len(set(facts)),
                      "source": f"{meta['url']}, {meta['path']}{category}/{res.name} ({commit})",
                      "licence": f"{meta['licence']}, {meta['copyright']} (prompts/lre/LICENSE)"}
        if as_read and not literal:
            properties["as_read"] = as_read
        out.append(Relation(relation.name, relation.templates, relation.neutral_templates, facts, properties,
                            relation.source))
    return out


def lre_as_read(relation: Relation) -> Relation:
    """``relation`` (from an ``lre:`` name) with each subject and object as the LRE reference reads its file
    (``properties.as_read``: literal ``\\uXXXX`` escapes, spaces kept); itself when nothing differs."""
    as_read = relation.properties.get("as_read") or {}
    if not any(f.subject in as_read or f.object in as_read for f in relation.facts):
        return relation
    return relation.with_facts([Fact(as_read.get(f.subject, f.subject), as_read.get(f.object, f.object))
                                for f in relation.facts])


def load_relations(names_or_paths: list | str | None = None, *, templates: list[str] | None = None,
                   neutral_templates: list[str] | None = None, subject_column: str = "subject",
                   object_column: str = "object", template_column: str = "template",
                   relation_column: str = "relation", relation: str | None = None, hf_kwargs: dict | None = None,
                   max_facts: int | None = None) -> list[Relation]:
    """Load relations; None = every bundled relation.

    Each item is a bundled relation name (``"country_capital"``), a JSON file in our schema or the LRE format
    (auto-detected), a .csv / .jsonl file of rows, a directory of such files, ``hf:NAME[:split]`` for
    ``datasets.load_dataset(NAME, split=split, **hf_kwargs)``, a ``datasets.Dataset`` or ``pandas.DataFrame`` (its
    rows read as a CSV file's; a ``DatasetDict`` is refused: pass one split), or ``lre:CATEGORY`` / ``lre:all`` /
    ``lre:NAME`` for the bundled LRE dataset (``...:literal``: its rows' text as the reference reads it; module
    doc; ``list_bundled(include_lre=True)`` lists the names). Row sources take their columns from
    ``subject_column``/``object_column`` (dotted names reach into nested records; whole numbers are read as their
    text), their templates from ``templates`` or else the distinct values of ``template_column``, and are split
    into one relation per value of ``relation_column`` when that column exists; otherwise the relation is named
    ``relation``, or else after the file or dataset (a DataFrame, or a Dataset without a hub name, needs
    ``relation``). ``max_facts``: each relation keeps its first that many distinct facts; .jsonl and .csv files
    are read row by row, and only up to there when they have no relation column (a .json file is read whole, and
    refused above ``MAX_JSON_BYTES``). A FIFO, device or socket is refused unopened.
    """
    bundled = _bundled_files()
    if names_or_paths is None:
        names_or_paths = sorted(bundled)
    elif isinstance(names_or_paths, (str, os.PathLike)) or _table_kind(names_or_paths):
        names_or_paths = [names_or_paths]
    if max_facts is not None and (type(max_facts) is not int or max_facts < 1):
        raise DatasetError(f"max_facts must be a whole number of at least 1 or None, got {max_facts!r}")
    if hf_kwargs is not None and not isinstance(hf_kwargs, dict):
        raise DatasetError(f"hf_kwargs must be a dict of datasets.load_dataset keywords, got {hf_kwargs!r}"[:300])
    row_kw = dict(subject_column=subject_column, object_column=object_column, template_column=template_column,
                  relation_column=relation_column, templates=templates, neutral_templates=neutral_templates,
                  max_facts=max_facts)
    out: list[Relation] = []
    for index, item in enumerate(names_or_paths):
        kind = _table_kind(item)
        if kind:
            out.extend(_read_table(item, kind, index, relation, **row_kw))
            continue
        if not isinstance(item, (str, os.PathLike)):
            raise DatasetError(f"item {index} of load_relations is a {type(item).__name__}: give a relation name, a "
                               f"path, hf:NAME, lre:NAME, a datasets.Dataset or a pandas.DataFrame")
        item_s = os.fspath(item)
        if special_file(item_s):
            raise DatasetError(f"{item_s!r} is {special_file(item_s)}, not a relation file or folder; refused "
                               f"(reading it could wait for ever): give a regular .json, .jsonl or .csv file")
        if item_s.startswith("hf:"):
            out.extend(_read_hf(item_s, hf_kwargs, relation, **row_kw))
        elif item_s.startswith("lre:"):
            out.extend(_read_lre(item_s))
        elif item_s in bundled:
            res = bundled[item_s]
            out.extend(_read_json_text(res.read_text(encoding="utf-8"), str(res)))
        elif os.path.isdir(item_s):
            files = sorted(p for p in Path(item_s).iterdir() if p.suffix.lower() in (".json", ".jsonl", ".csv"))
            if not files:
                raise DatasetError(f"{item_s}: directory has no .json, .jsonl or .csv relation files")
            for p in files:
                out.extend(_read_path(p, row_kw, relation))
        elif os.path.isfile(item_s):
            out.extend(_read_path(Path(item_s), row_kw, relation))
        else:
            raise DatasetError(f"{item_s!r} is not a bundled relation, file, directory, hf:NAME or lre:NAME"
                               f"{_did_you_mean(item_s)}; bundled relations: {', '.join(sorted(bundled))}; the LRE "
                               f"dataset: lre:all, {', '.join('lre:' + c for c in LRE_CATEGORIES)} or lre:NAME "
                               f"(llmprobe.datasets.list_bundled(include_lre=True) lists its 47 names)")
    if max_facts is not None:
        out = [rel.with_facts(rel.facts[:max_facts]) if len(rel.facts) > max_facts else rel for rel in out]
    seen: dict[str, str] = {}
    for rel in out:
        if rel.name in seen:
            raise DatasetError(f"{rel.source}: field 'name' repeats relation {rel.name!r} (also in {seen[rel.name]})"
                               f"; relations loaded together need distinct names")
        seen[rel.name] = rel.source
    return out


def format_json(obj: dict) -> str:
    """JSON text of a relation dict in our schema, one fact per line."""
    parts = []
    for key, val in obj.items():
        if key == "facts":
            body = ",\n".join("  " + json.dumps(f, ensure_ascii=False) for f in val)
            parts.append(f' "facts": [\n{body}\n ]')
        else:
            text = json.dumps(val, ensure_ascii=False, indent=1).replace("\n", "\n ")
            parts.append(f" {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def format_relation(relation: Relation) -> str:
    """JSON text in our schema, one fact per line."""
    return format_json(relation.to_dict())


def save_relation(relation: Relation, path: str | os.PathLike) -> Path:
    """Write ``relation`` in our schema, atomically (temp file in the same folder, then ``os.replace``)."""
    path = Path(path)
    relation_from_dict(relation.to_dict(), str(path))  # refuse to write what we could not read back
    write_text(path, format_relation(relation))
    return path
