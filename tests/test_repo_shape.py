"""The repository's shape, as facts a reviewer can check: library and model modules stay under
400 lines, ``launch/`` holds only entry points and cluster scripts, imports run one way
(``launch`` -> ``planning``/``interop``/``analysis`` -> ``training`` -> ``model``), ``model/`` is plain PyTorch,
and nothing refers to files a user who clones the repository does not have.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = ("model", "training", "planning", "interop", "analysis")
# What each package may import from this repository (one direction only).
ALLOWED = {"model": {"model"}, "training": {"model", "training"},
           "planning": {"model", "training", "planning"},
           "interop": {"model", "training", "interop"},
           "analysis": {"model", "training", "analysis"}}
MAX_LINES = 400


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / p for p in out.split() if (REPO / p).is_file()]


def _repo_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", LIBRARY)
def test_library_modules_are_short_and_import_one_way(package):
    for path in _tracked(f"{package}/*.py", f"{package}/**/*.py"):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= MAX_LINES, f"{path.relative_to(REPO)}: {lines} lines (at most {MAX_LINES})"
        imported = _repo_imports(path) & {"model", "training", "planning", "interop", "analysis",
                                          "launch"}
        wrong = imported - ALLOWED[package]
        assert not wrong, f"{path.relative_to(REPO)} imports {sorted(wrong)}"
        if package == "model":
            assert "deepspeed" not in _repo_imports(path), f"{path.relative_to(REPO)} imports deepspeed"


def test_launch_holds_only_entry_points_and_cluster_scripts():
    for path in _tracked("launch/*"):
        if path.name == "__init__.py":
            continue
        if path.suffix == ".py":
            text = path.read_text(encoding="utf-8")
            assert 'if __name__ == "__main__":' in text, f"{path.name} is not an entry point"
            assert len(text.splitlines()) <= 200, f"{path.name} is not thin ({len(text.splitlines())} lines)"
        else:
            assert path.suffix in (".sh", ".sbatch"), f"launch/{path.name} is neither"


def test_no_reference_to_files_outside_the_repository():
    pattern = re.compile(r"\.\./shared|DESIGN\.md|anchors\.md|shared/notes")
    for path in _tracked():
        if path.suffix in (".py", ".md", ".sh", ".sbatch", ".yaml", ".json", ".ini", ".txt"):
            if path == Path(__file__):
                continue
            found = pattern.search(path.read_text(encoding="utf-8", errors="replace"))
            assert not found, f"{path.relative_to(REPO)} refers to {found.group(0)}"


# ------------------------------------------------------------------------------------------------
# The import graph: no circle anywhere, and training/'s sub-packages in floors.

PACKAGES = ("model", "data_pipeline", "training", "planning", "interop", "analysis", "launch")
# training/'s sub-packages and leaf modules from the top floor down: each imports only its own
# sub-package and the floors below it (the package docstring of training/ says the same).
TRAINING_FLOORS = [{"run"}, {"step"}, {"engine", "config"}, {"checkpoint", "resilience", "data", "optim"},
                   {"files", "gpus", "tracking"}]


def _module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the repository modules it imports, at any depth of the file (lazy imports
    inside functions count: they close a circle all the same)."""
    files = [p for pkg in PACKAGES for p in _tracked(f"{pkg}/*.py", f"{pkg}/**/*.py")]
    modules = {_module_of(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                targets |= submodules                     # ``from package import module``
                if len(submodules) < len(node.names):     # a name the module itself defines
                    targets.add(node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _training_floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "training" or len(parts) < 2:
        return None
    return next(i for i, floor in enumerate(TRAINING_FLOORS) if parts[1] in floor)


def test_no_module_imports_one_that_imports_it_back():
    graph = _import_graph()
    assert "training.run.trainer" in graph and graph["launch.train"] >= {"training.run.trainer"}
    assert _circles(graph) == []
    # The check itself: a circle put in by hand is found.
    assert _circles({**graph, "data_pipeline.sources": graph["data_pipeline.sources"] | {"data_pipeline.readers"}})


def test_training_sub_packages_import_only_downward():
    graph = _import_graph()
    placed = {m.split(".")[1] for m in graph if m.startswith("training.") and m.count(".") >= 1}
    assert placed == set().union(*TRAINING_FLOORS), "every sub-package of training/ has a floor"
    for module, targets in graph.items():
        floor = _training_floor(module)
        for target in targets:
            other = _training_floor(target)
            if module.startswith("training.") and target.startswith("training."):
                same = module.split(".")[1] == target.split(".")[1]
                assert same or other > floor, f"{module} imports {target}, which is not below it"
            elif module.startswith(("model.", "data_pipeline.")) or module in ("model", "data_pipeline"):
                assert not target.startswith("training"), f"{module} imports {target}"


# ------------------------------------------------------------------------------------------------
# The rooms around the code: tests and benchmarks.

KEPT_ENTRY_POINTS = {"benchmarks/dense_vs_sparse.py", "benchmarks/planner_vs_published.py",
                     "benchmarks/pipeline_schedules.py"}
# A name two library modules may share: a sub-package's builder, the MoE config nested in the
# model's, and an entry point under launch/ with the library module it runs.
SHARED_NAMES = {"__init__", "build", "config"}


def _package_graph(package: str) -> dict[str, set[str]]:
    """``package``'s import graph with each sub-package drawn as one node (``model.moe``,
    ``model.parallel``) and each top-level module as its own: an import from a sub-package up to
    a module that imports the sub-package back is a circle here."""
    def node(module: str) -> str:
        parts = module.split(".")
        sub = REPO / package / parts[1] if len(parts) > 2 else None
        return ".".join(parts[:2]) if sub is not None and sub.is_dir() else module
    graph: dict[str, set[str]] = {}
    for module, targets in _import_graph().items():
        if module.split(".")[0] == package:
            graph.setdefault(node(module), set()).update(
                node(t) for t in targets if t.split(".")[0] == package)
    return {k: v - {k} for k, v in graph.items()}


@pytest.mark.parametrize("package", ["model", "data_pipeline"])
def test_no_sub_package_imports_up_into_its_parent(package):
    graph = _package_graph(package)
    assert _circles(graph) == [], f"{package}/: a sub-package imports a module above it"
    if package == "model":       # the check itself: MoEConfig taken from model.config again
        assert _circles({**graph, "model.moe": graph["model.moe"] | {"model.config"}})


def test_nothing_outside_tests_imports_tests():
    for path in _tracked("*.py", "**/*.py"):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith("tests/"):
            assert "tests" not in _repo_imports(path), f"{rel} imports from tests/"


def test_benchmarks_run_as_modules_without_a_path_bootstrap():
    """Every benchmark runs as ``python -m benchmarks.<trade>.<name>`` from the repository root;
    only the entry points kept at the paths users name put the root on ``sys.path``."""
    scripts = _tracked("benchmarks/*.py", "benchmarks/**/*.py")
    assert {p.relative_to(REPO).as_posix() for p in scripts if p.parent == REPO / "benchmarks"} \
        - {"benchmarks/__init__.py"} == KEPT_ENTRY_POINTS
    for path in scripts:
        rel = path.relative_to(REPO).as_posix()
        bootstrap = "sys.path.insert" in path.read_text(encoding="utf-8")
        assert bootstrap == (rel in KEPT_ENTRY_POINTS), f"{rel}: sys.path bootstrap {bootstrap}"


def test_no_results_under_docs_and_no_module_name_twice():
    assert _tracked("docs/*.json", "docs/**/*.json") == [], "study results belong beside their benchmark"
    names: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in _tracked(f"{package}/*.py", f"{package}/**/*.py"):
            names.setdefault(path.stem, []).append(path.relative_to(REPO).as_posix())
    for name, paths in names.items():
        libraries = [p for p in paths if not p.startswith("launch/")]
        assert name in SHARED_NAMES or len(libraries) <= 1, f"{name}.py twice: {paths}"
