"""The house keeps its layers: each module imports only modules of its own or a lower layer, no import cycle,
no project-internal import inside a function (docs/CONTRACTS.md, "Layers"). Parsed from the source (ast), so
an import hidden in a function body counts too. ``test_the_checker_fails_on_*`` plant each fault in a small
tree and see the checker name it."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("llmprobe", "synthetic", "prompts")

# module prefix -> layer; the longest matching prefix wins (docs/CONTRACTS.md draws the same table)
LAYERS = {
    "llmprobe": 0, "llmprobe.checks": 0, "llmprobe.io": 0, "llmprobe.metric": 0, "llmprobe.names": 0,
    "llmprobe.datasets": 1, "llmprobe.geometry": 1, "prompts": 1,
    "llmprobe.model": 2,
    "llmprobe.analyses": 3, "synthetic": 3,
    "llmprobe.report": 4,
    "llmprobe.settings": 5, "llmprobe.jobs": 5,
    "llmprobe.commands": 6, "llmprobe.cli": 6,
}
SYNTHETIC_MAX = 2        # synthetic/ (layer 3) imports llmprobe's layers 0-2 only
USES_SYNTHETIC = 5       # llmprobe modules below this layer never import synthetic/
# third-party packages a function may import where it uses them: the optional extras; any other package only
# with a "# lazy: WHY" comment on the import line (start-up time: e.g. the settings must not load torch)
LAZY_OK = {"ray", "nnsight", "transformer_lens", "pandas", "matplotlib", "bitsandbytes", "pycountry", "countryinfo"}
LAZY_MARK = "# lazy:"


def modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """{dotted module name: file} of the packages under ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def layer(name: str) -> int:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[best]


def imports(name: str, path: Path, known: dict) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function) for each project import of module ``name``, and the
    third-party imports made inside functions as ('third-party:PKG', line, True)."""
    text = path.read_text(encoding="utf-8")
    lines, tree = text.splitlines(), ast.parse(text)
    inner = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        resolved = set()
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                resolved.add(target)
        for target in sorted(resolved):
            out.append((target, node.lineno, id(node) in inner))
        if not resolved and id(node) in inner:
            top = targets[0].split(".")[0]
            marked = any(LAZY_MARK in line for line in lines[node.lineno - 1:node.end_lineno])
            if top not in sys.stdlib_module_names and top not in PACKAGES and not marked:
                out.append((f"third-party:{top}", node.lineno, True))
    return out


def faults(root: Path, packages=PACKAGES) -> list[str]:
    """Every broken rule of the house under ``root``, one line each (empty: the house stands)."""
    known = modules(root, packages)
    edges: dict[str, set] = {m: set() for m in known}
    found = []
    for name, path in known.items():
        here = layer(name)
        for target, line, inside in imports(name, path, known):
            where = f"{path.relative_to(root)}:{line}"
            if target.startswith("third-party:"):
                if target.split(":")[1] not in LAZY_OK:
                    found.append(f"{where}: imports {target.split(':')[1]} inside a function")
                continue
            edges[name].add(target)
            if inside:
                found.append(f"{where}: imports {target} inside a function (imports go at the module's top)")
            if layer(target) > here:
                found.append(f"{where}: {name} (layer {here}) imports {target} (layer {layer(target)}), a layer up")
            if name.startswith("synthetic") and target.startswith("llmprobe") and layer(target) > SYNTHETIC_MAX:
                found.append(f"{where}: synthetic imports {target}; it may use llmprobe's layers 0-{SYNTHETIC_MAX}")
            if name.startswith("llmprobe") and target.startswith("synthetic") and here < USES_SYNTHETIC:
                found.append(f"{where}: {name} (layer {here}) imports {target}; only jobs and the CLI use synthetic")
    found += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(edges)]
    return found


def cycles(edges: dict[str, set]) -> list[list[str]]:
    """One cycle through each strongly connected group of more than one module (Tarjan), package ``__init__``
    importing its own submodules left out."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w.startswith(v + "."):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in list(edges):
        if v not in index:
            visit(v)
    return [group + [group[0]] for group in groups]


def test_the_house_keeps_its_layers():
    assert faults(ROOT) == []


def test_every_module_has_a_layer():
    for name in modules(ROOT):
        assert any(name == p or name.startswith(p + ".") for p in LAYERS), f"{name} has no layer in LAYERS"


def _plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    for package in ("llmprobe", "synthetic", "llmprobe/model", "llmprobe/jobs", "llmprobe/report"):
        init = root / package / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text("", encoding="utf-8")
    return root


def test_the_checker_fails_on_an_upward_import_a_cycle_and_an_import_in_a_function(tmp_path):
    root = _plant(tmp_path, {
        "llmprobe/metric.py": "from llmprobe.report.render import x\n",              # L0 -> L4: up
        "llmprobe/model/a.py": "from llmprobe.model import b\n",                      # a <-> b: a cycle
        "llmprobe/model/b.py": "def f():\n    from llmprobe.model import a\n",        # ... and inside a function
        "llmprobe/report/render.py": "x = 1\n",
        "synthetic/train.py": "import llmprobe.jobs.main\n",                          # synthetic -> L5
        "llmprobe/jobs/main.py": "def g():\n    import torch\n",                      # required package, lazily
        "llmprobe/jobs/ok.py": "def g():\n    import torch  # lazy: start-up time\n",  # ... said why: fine
    })
    found = "\n".join(faults(root, ("llmprobe", "synthetic")))
    assert "llmprobe.metric (layer 0) imports llmprobe.report.render (layer 4), a layer up" in found
    assert "import cycle: llmprobe.model.a -> llmprobe.model.b -> llmprobe.model.a" in found
    assert "llmprobe/model/b.py:2: imports llmprobe.model.a inside a function" in found
    assert "synthetic imports llmprobe.jobs.main" in found
    assert "llmprobe/jobs/main.py:2: imports torch inside a function" in found and "ok.py" not in found
    clean = _plant(tmp_path / "clean", {"llmprobe/metric.py": "import math\n",
                                        "llmprobe/model/a.py": "from llmprobe import metric\n",
                                        "llmprobe/jobs/main.py": "def g():\n    import ray\n"})
    assert faults(clean, ("llmprobe", "synthetic")) == []


def test_importing_the_settings_loads_no_torch():
    """``import llmprobe.settings`` (what ``llmprobe config`` and a settings check need) stays light."""
    code = "import sys, llmprobe.settings, llmprobe.names, llmprobe.checks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


# import name -> distribution name, where they differ
DISTRIBUTIONS = {"sklearn": "scikit-learn", "transformer_lens": "transformer-lens", "huggingface_hub": "huggingface-hub"}


def test_every_imported_package_is_declared():
    """Each third-party package the code imports is a dependency or an extra of pyproject.toml (with a bound)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    names = {re.split(r"[<>=!\[ ]", d, maxsplit=1)[0].lower() for d in declared}
    assert all(re.search(r"[<>=]=?\d", d) for d in declared if not d.startswith("llmprobe")), "a bound is missing"
    imported = set()
    for path in modules(ROOT).values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m not in PACKAGES}
    missing = sorted(m for m in third_party if DISTRIBUTIONS.get(m, m).lower() not in names)
    assert missing == []


def test_no_benchmark_script_shadows_a_package_of_the_repository():
    """``python benchmarks/X.py`` puts benchmarks/ first on sys.path: a script named like a package (a
    benchmarks/synthetic.py once did) hides it, and every benchmark importing the package through llmprobe stops."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert {"llmprobe", "synthetic"} <= packages and not scripts & packages, scripts & packages
