"""Synthetic factual-recall tasks: fact tables, random bijections, k-hop queries and chain-of-thought sequences.

Token ids (one shared *input* id space, separate *output* space):

* inputs:  ``0 .. N-1`` are subjects, ``N .. N+R-1`` are relations. In k-hop and chain-of-thought sequences the
  intermediate entities are subjects, so they reuse the subject ids.
* outputs: the model predicts over ``n_outputs`` classes. For one-hop tasks these are the attributes (the paper's
  shared attribute set, ``|A| = N`` for bijections; for general tables the union of all relations' attribute
  strings, deduplicated by string). For k-hop tasks the attributes *are* subjects, so output id = subject id.

A task hands the trainer one :class:`SeqData`: ``input_ids`` [F, L], ``target_pos`` [T] (positions whose next-entity
prediction is trained) and ``targets`` [F, T]. One-hop: ``(s, r) -> a`` with ``target_pos = [1]``. k-hop without
chain-of-thought: ``(s, r1..rk) -> e_k`` at the last position. Chain-of-thought: ``(s, r1..rk, e1..e_{k-1})`` with
targets ``e1..ek`` at positions ``k..2k-1`` (teacher forcing: the model reads the true intermediate entities).

Everything is seeded: the same arguments give the same tables.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

from llmprobe.checks import UsageError, check_fields, read_json
from llmprobe.datasets import FactTable, load_relations
from llmprobe.io import write_text


def multinomial_bits(counts: list[int]) -> float:
    """log2 of the multinomial (sum counts)! / prod_a counts_a!: the bits that say which item gets which label once
    the labels' histogram ``counts`` is known."""
    return (math.lgamma(sum(counts) + 1) - sum(math.lgamma(c + 1) for c in counts)) / math.log(2)


@dataclass
class SeqData:
    """Training/evaluation sequences: ``input_ids`` [F, L], ``targets`` [F, T] at positions ``target_pos`` [T]."""

    input_ids: torch.Tensor
    target_pos: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_predictions(self) -> int:
        return int(self.targets.numel())

    def to(self, device) -> "SeqData":
        return SeqData(self.input_ids.to(device), self.target_pos.to(device), self.targets.to(device))


@dataclass
class FactTask:
    """R relations over one shared subject set: ``table[s, r]`` = output (attribute) id of a_r(s), -1 = no fact.

    ``attr_index[r]`` maps relation r's local attribute index (as in :class:`llmprobe.datasets.FactTable`) to the
    global output id; ``attributes`` names the ``n_outputs`` output classes.
    """

    table: torch.Tensor                      # LongTensor [N, R]
    n_outputs: int
    kind: str = "table"                      # "bijection" | "function" | "table"
    seed: int | None = None
    subjects: list[str] | None = None
    relations: list[str] | None = None
    attributes: list[str] | None = None
    attr_index: list[torch.Tensor] | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.table = torch.as_tensor(self.table, dtype=torch.long)
        if self.table.dim() != 2:
            raise ValueError("table must be [n_subjects, n_relations]")
        if self.table.max() >= self.n_outputs or self.table.min() < -1:
            raise ValueError("table entries must be -1 or in [0, n_outputs)")
        if self.subjects is None:
            self.subjects = [f"s{i}" for i in range(self.n_subjects)]
        if self.relations is None:
            self.relations = [f"r{i}" for i in range(self.n_relations)]
        if self.attributes is None:
            self.attributes = [f"a{i}" for i in range(self.n_outputs)]

    # ----------------------------------------------------------------- sizes
    @property
    def n_subjects(self) -> int:
        return int(self.table.shape[0])

    @property
    def n_relations(self) -> int:
        return int(self.table.shape[1])

    @property
    def n_facts(self) -> int:
        return int((self.table >= 0).sum())

    @property
    def vocab_size(self) -> int:
        """Size of the input id space (subjects then relations)."""
        return self.n_subjects + self.n_relations

    def relation_attributes(self, r: int) -> torch.Tensor:
        """Output ids that relation r can take (all outputs for bijections onto the shared set)."""
        if self.attr_index is not None:
            return self.attr_index[r]
        return torch.arange(self.n_outputs)

    # ----------------------------------------------------------------- data
    def facts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All present facts as (subject, relation, output id) LongTensors [F], subject-major order."""
        s, r = torch.nonzero(self.table >= 0, as_tuple=True)
        return s, r, self.table[s, r]

    def data(self) -> SeqData:
        """One-hop sequences ``[s, N + r]`` with the attribute as the target at position 1."""
        s, r, a = self.facts()
        ids = torch.stack([s, r + self.n_subjects], dim=1)
        return SeqData(ids, torch.tensor([1]), a[:, None].clone())

    def bits(self) -> float:
        """Information in the table, in bits: sum over relations of log2 of the multinomial
        ``n_r! / prod_a c_{r,a}!`` (n_r = subjects with a fact for r, c_{r,a} = subjects mapped to a).

        This is the number of bits needed to say which subject gets which attribute once the attribute histogram is
        known; for a bijection it is log2(N!) per relation, so R bijections carry R*log2(N!) bits (the paper's count).
        """
        total = 0.0
        for r in range(self.n_relations):
            col = self.table[:, r]
            col = col[col >= 0]
            total += multinomial_bits(torch.bincount(col, minlength=self.n_outputs).tolist())
        return total

    def bits_joint(self) -> float:
        """Information in the table counted jointly, in bits: :meth:`bits` with each relation that is a function of
        another relation charged only for that function (the chain rule over exact functional dependencies).

        Relations are coded in order of decreasing number of distinct attributes (finer first, table order on
        ties). Relation r's subjects are grouped by the attribute of an earlier relation p (a subject without a p
        fact is a group of its own); when every group holds one attribute of r, r is a function of the groups and
        costs log2(G! / prod_a g_a!) (G groups, g_a of them mapped to a: the multinomial of the function), else
        log2(n_r! / prod_a c_{r,a}!) as in :meth:`bits`; r takes the cheapest p. So joint <= :meth:`bits`, with
        equality when no relation is a function of a coarser one: a relation that is a function of a bijection
        costs what it costs alone, so R independent bijections carry R*log2(N!) here too. Softer dependencies (a
        relation that mostly follows another) are not discounted: this is still an upper bound on the table's
        information. Example: a country's continent is a function of its subregion, so it costs the 22 subregions'
        map onto the continents instead of the 193 countries'.
        """
        present = self.table >= 0                                                   # [N, R]
        order = sorted(range(self.n_relations), key=lambda r: -len(torch.unique(self.table[present[:, r], r])))
        total = 0.0
        for k, r in enumerate(order):
            has_r = present[:, r]
            col = self.table[has_r, r]
            best = multinomial_bits(torch.bincount(col, minlength=self.n_outputs).tolist())
            for p in order[:k]:
                # group key: p's attribute, or a fresh key per subject without a p fact
                parent = torch.where(present[has_r, p], self.table[has_r, p],
                                     self.n_outputs + torch.arange(len(col)))
                groups, group_of = torch.unique(parent, return_inverse=True)
                pairs = torch.unique(torch.stack([group_of, col], dim=1), dim=0)         # [(group, attribute)]
                if len(pairs) == len(groups):                                           # one attribute per group
                    best = min(best, multinomial_bits(torch.bincount(pairs[:, 1], minlength=self.n_outputs).tolist()))
            total += best
        return total

    # ----------------------------------------------------------------- (de)serialisation
    def to_json(self) -> dict:
        return {
            "kind": self.kind, "seed": self.seed, "n_outputs": self.n_outputs, "table": self.table.tolist(),
            "subjects": self.subjects, "relations": self.relations, "attributes": self.attributes,
            "attr_index": None if self.attr_index is None else [a.tolist() for a in self.attr_index],
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, obj: dict, source: str = "task") -> "FactTask":
        """The task of :meth:`to_json`'s ``obj``, its types checked: UsageError naming ``source`` (the file) and
        the field otherwise."""
        check_fields(obj, source, TASK_FIELDS, required=("table", "n_outputs"))
        attr_index = obj.get("attr_index")
        return cls(table=id_tensor(obj["table"], source, "table", 2), n_outputs=obj["n_outputs"],
                   kind=obj.get("kind") or "table", seed=obj.get("seed"), subjects=obj.get("subjects"),
                   relations=obj.get("relations"), attributes=obj.get("attributes"),
                   attr_index=None if attr_index is None else [id_tensor(a, source, f"attr_index[{i}]", 1)
                                                               for i, a in enumerate(attr_index)],
                   meta=obj.get("meta") or {})

    def save(self, path: str) -> None:
        write_text(path, json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str) -> "FactTask":
        return cls.from_json(read_json(path), str(path))


# the types of a task JSON's fields (FactTask.to_json); None: null allowed
TASK_FIELDS = {"table": list, "n_outputs": int, "kind": (str, None), "seed": (int, None), "subjects": (list, None),
               "relations": (list, None), "attributes": (list, None), "attr_index": (list, None),
               "meta": (dict, None)}


def id_tensor(value, source: str, key: str, dim: int) -> torch.Tensor:
    """A JSON ``dim``-deep list of whole numbers (field ``key`` of ``source``) as a LongTensor; UsageError
    naming both when it is anything else (strings, floats, ragged rows)."""
    try:
        tensor = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        tensor = None
    if tensor is None or tensor.dim() != dim or (tensor.numel() and tensor.dtype != torch.long):
        what = {1: "a list of whole numbers", 2: "a list of rows of whole numbers"}.get(dim, f"{dim}-deep lists")
        raise UsageError(f"{source}: field {key!r} must be {what}")
    return tensor.long()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def reorder_subjects(task: FactTask, seed: int) -> FactTask:
    """The same facts with the subjects in a seeded random order (rows of ``table`` and ``subjects`` permuted by
    ``torch.randperm(N)`` from ``seed``): which embedding row a subject gets, and the order of the facts in a batch.
    """
    perm = torch.randperm(task.n_subjects, generator=_generator(seed))
    return FactTask(task.table[perm], task.n_outputs, task.kind, task.seed, [task.subjects[i] for i in perm],
                    list(task.relations), list(task.attributes), task.attr_index,
                    {**task.meta, "subject_order_seed": seed})


def random_bijections(n_subjects: int, n_relations: int, seed: int = 0) -> FactTask:
    """The paper's setting: R independent uniformly random bijections from N subjects onto a shared attribute set
    of size N (attribute ids 0..N-1)."""
    g = _generator(seed)
    cols = [torch.randperm(n_subjects, generator=g) for _ in range(n_relations)]
    table = torch.stack(cols, dim=1) if cols else torch.empty(n_subjects, 0, dtype=torch.long)
    return FactTask(table, n_outputs=n_subjects, kind="bijection", seed=seed)


def random_functions(n_subjects: int, n_relations: int, n_attributes: int | list[int], seed: int = 0,
                     shared: bool = False) -> FactTask:
    """Many-to-one maps: relation r sends each subject to a uniformly random one of ``n_attributes[r]`` values.

    ``shared=True`` draws every relation from one attribute set of size ``max(n_attributes)``; otherwise each
    relation has its own attribute ids (offset per relation), like distinct relations in a real fact table.
    """
    if isinstance(n_attributes, int):
        n_attributes = [n_attributes] * n_relations
    if len(n_attributes) != n_relations:
        raise ValueError("need one attribute count per relation")
    g = _generator(seed)
    cols, attr_index, offset = [], [], 0
    for k in n_attributes:
        col = torch.randint(0, k, (n_subjects,), generator=g)
        if shared:
            cols.append(col)
            attr_index.append(torch.arange(k))
        else:
            cols.append(col + offset)
            attr_index.append(torch.arange(offset, offset + k))
            offset += k
    n_out = max(n_attributes) if shared else offset
    return FactTask(torch.stack(cols, dim=1), n_outputs=n_out, kind="function", seed=seed, attr_index=attr_index)


def from_fact_table(fact_table) -> FactTask:
    """Build a task from an ``llmprobe.datasets.FactTable`` (subjects, relations, per-relation attribute lists and
    a [n_subjects, n_relations] index table, -1 = missing). Attribute strings are deduplicated across relations into
    one output vocabulary (as a language model has one token vocabulary); ``attr_index[r]`` maps relation r's local
    attribute index to the output id."""
    names: dict[str, int] = {}
    attr_index = []
    for values in fact_table.attributes:
        attr_index.append(torch.tensor([names.setdefault(v, len(names)) for v in values], dtype=torch.long))
    local = torch.as_tensor(fact_table.table, dtype=torch.long)
    table = torch.full_like(local, -1)
    for r, index in enumerate(attr_index):
        col = local[:, r]
        ok = col >= 0
        table[ok, r] = index[col[ok]]
    return FactTask(table, n_outputs=len(names), kind="table", subjects=list(fact_table.subjects),
                    relations=list(fact_table.relations), attributes=list(names), attr_index=attr_index,
                    meta={"source": "llmprobe.datasets.FactTable"})


def from_relations(names_or_paths: list[str] | None = None, min_relations: int = 1) -> FactTask:
    """Load relations with llmprobe's loaders (``prompts/`` names or JSON paths; None = all bundled relations)
    and build their shared-subject fact table."""
    relations = load_relations(names_or_paths)
    return from_fact_table(FactTable.from_relations(relations, min_relations=min_relations))


def load_facts(spec: str) -> FactTask:
    """``--facts`` argument: a task JSON saved by :meth:`FactTask.save`, or a comma-separated list of relation
    names / relation JSON paths for :func:`from_relations` (``all`` = every bundled relation)."""
    if os.path.isfile(spec):
        obj = read_json(spec)
        if isinstance(obj, dict) and "table" in obj and "n_outputs" in obj:
            return FactTask.from_json(obj, spec)
    if spec in ("all", "*"):
        return from_relations(None)
    return from_relations([p for p in spec.split(",") if p])


# --------------------------------------------------------------------------- multi-hop
@dataclass
class KHopTask:
    """k-hop queries over R subject->subject maps: (s, r1..rk) -> a_rk(...a_r1(s)).

    ``base.table`` [N, R] holds subject ids (the attributes are subjects). ``queries`` [Q, k] are the relation
    sequences asked for every subject (all R^k when ``n_sequences`` is None). With ``cot=True`` the data are
    chain-of-thought sequences that emit every intermediate entity.
    """

    base: FactTask
    hops: int
    cot: bool = False
    sequences: torch.Tensor | None = None     # [Q, k] relation ids

    def __post_init__(self):
        if self.base.n_outputs != self.base.n_subjects:
            raise ValueError("k-hop tasks need subject->subject maps")
        if self.sequences is None:
            R, k = self.base.n_relations, self.hops
            self.sequences = torch.cartesian_prod(*[torch.arange(R)] * k).reshape(-1, k) if k > 1 else \
                torch.arange(R)[:, None]

    n_subjects = property(lambda self: self.base.n_subjects)
    n_relations = property(lambda self: self.base.n_relations)
    n_outputs = property(lambda self: self.base.n_subjects)
    vocab_size = property(lambda self: self.base.vocab_size)
    kind = property(lambda self: f"{self.hops}hop" + ("-cot" if self.cot else ""))

    @property
    def seq_len(self) -> int:
        return 2 * self.hops if self.cot else self.hops + 1

    def chains(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(subjects [F], relation sequences [F, k], entities [F, k]) with entities[:, i] = answer after hop i+1."""
        N, Q = self.n_subjects, self.sequences.shape[0]
        s = torch.arange(N).repeat_interleave(Q)
        rel = self.sequences.repeat(N, 1)
        ent, cur = [], s
        for i in range(self.hops):
            cur = self.base.table[cur, rel[:, i]]
            ent.append(cur)
        return s, rel, torch.stack(ent, dim=1)

    def data(self) -> SeqData:
        s, rel, ent = self.chains()
        k, N = self.hops, self.n_subjects
        if not self.cot:
            ids = torch.cat([s[:, None], rel + N], dim=1)
            return SeqData(ids, torch.tensor([k]), ent[:, -1:].clone())
        ids = torch.cat([s[:, None], rel + N, ent[:, :-1]], dim=1)
        return SeqData(ids, torch.arange(k, 2 * k), ent.clone())

    def bits(self) -> float:
        """Bits in the underlying maps (the k-hop answers are a function of them): R*log2(N!) for bijections."""
        return self.base.bits()


def random_khop(n_subjects: int, n_relations: int, hops: int, cot: bool = False, seed: int = 0,
                n_sequences: int | None = None) -> KHopTask:
    """R random permutations of the subjects, queried with all R^k relation sequences (or ``n_sequences`` of them,
    drawn without replacement with the same seed)."""
    base = random_bijections(n_subjects, n_relations, seed)
    base.kind = "permutation"
    task = KHopTask(base, hops, cot)
    if n_sequences is not None and n_sequences < task.sequences.shape[0]:
        g = _generator(seed + 7919)
        task.sequences = task.sequences[torch.randperm(task.sequences.shape[0], generator=g)[:n_sequences]]
    return task


