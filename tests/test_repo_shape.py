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
