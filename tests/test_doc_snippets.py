"""The Python snippets of the pages run as written.

A snippet is a fenced block opened with ```` ```python ```` or ```` ```py ```` in the README,
``ds_configs/README.md``, ``benchmarks/README.md`` or any page under ``docs/``. Each is checked
in two ways:

- **Imports**: every ``import`` and ``from ... import`` line resolves. For a module of this
  repository (``model``, ``training``, ...) the module's file must exist and every imported name
  must be a sub-module or a name the module defines or imports at its top level; any other
  module must be installed.
- **Run**: the snippets of one page run in the order they appear, one after another in one
  Python process started from the repository root (as ``python`` started there runs what is
  pasted into it), so a snippet may use the names and files of the page's earlier snippets. The
  root is the repository as a fresh clone has it (its tracked entries, no ``runs/``): a snippet
  that reads what a command of the page writes (a training run) is marked imports-only.
  A failing snippet fails the page, with the page's file and line in the traceback. The process
  is forked from the warm launcher's server (``tests.runs.python``: the libraries imported once),
  with a timeout. A snippet whose last lines are comments states its output: those lines,
  without their ``# ``, must be the last lines it prints.

A snippet that cannot run here (it needs a GPU, an HF checkpoint, a trained run, or minutes) is
only import-checked when the line just before its fence (blank lines aside) is the comment

    <!-- snippet: imports-only: why -->

with the reason after the colon (GitHub shows nothing of it). ``docs/README.md`` states the same
rule for readers.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_doc_pointers import defined
from tests.test_docs import DOCS, REPO

FENCE = re.compile(r"^```(?:python|py)\b[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*snippet:\s*imports-only\s*:\s*(\S[^>]*?)\s*-->\s*$")
SEPARATOR = "----- end of snippet -----"        # printed after each snippet, to split the output
PAGE_TIMEOUT_S = 240
REPO_PACKAGES = {p.parent.name for p in REPO.glob("*/__init__.py")}


@dataclass
class Snippet:
    page: Path
    line: int                       # the page's line of the snippet's first line
    source: str
    imports_only: str | None        # the marker's reason, or None: the snippet runs


def snippets(page: Path, text: str | None = None) -> list[Snippet]:
    """The Python snippets of ``page`` (or of ``text``, read as if it were ``page``)."""
    text = page.read_text(encoding="utf-8") if text is None else text
    out = []
    for block in FENCE.finditer(text):
        before = [x for x in text[:block.start()].splitlines() if x.strip()]
        marker = MARKER.search(before[-1]) if before else None
        out.append(Snippet(page, text[:block.start(1)].count("\n") + 1, block.group(1),
                           marker.group(1) if marker else None))
    return out


def _module_file(name: str) -> Path | None:
    path = REPO.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _open_namespace(path: Path) -> bool:
    """``path`` defines ``__getattr__`` or imports ``*`` at its top level: any name may exist."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
               or isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in tree.body)


def import_problems(snippet: Snippet) -> list[str]:
    """Every import of ``snippet`` that does not resolve, as ``page:line: why``."""
    where = f"{snippet.page.relative_to(REPO).as_posix() if snippet.page.is_relative_to(REPO) else snippet.page}"
    try:
        tree = ast.parse(snippet.source)
    except SyntaxError as err:
        return [f"{where}:{snippet.line + (err.lineno or 1) - 1}: not Python: {err.msg}"]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            wanted = [(node.module, a.name) for a in node.names]
        else:
            continue
        at = f"{where}:{snippet.line + node.lineno - 1}"
        for module, name in wanted:
            if module.split(".")[0] not in REPO_PACKAGES:
                if importlib.util.find_spec(module.split(".")[0]) is None:
                    out.append(f"{at}: {module} is not installed")
                continue
            path = _module_file(module)
            if path is None:
                out.append(f"{at}: no module {module} in the repository")
            elif name not in (None, "*") and _module_file(f"{module}.{name}") is None \
                    and name not in defined(path)[1] and not _open_namespace(path):
                out.append(f"{at}: {module} ({path.relative_to(REPO)}) has no {name}")
    return out


def _stated_output(source: str) -> list[str]:
    """The comment lines that end ``source`` (after its last line of code), without ``# ``."""
    lines = source.rstrip().splitlines()
    tail = []
    while lines and lines[-1].lstrip().startswith("#"):
        tail.insert(0, re.sub(r"^\s*# ?", "", lines.pop()))
    return tail if lines else []


def _fresh_root(tmp_path: Path) -> Path:
    """The repository as a fresh clone has it: a folder of links to its tracked top-level
    entries, without what runs leave behind (``runs/``, ignored by git), so that a snippet that
    reads a run's output passes only where the page makes that run."""
    import subprocess
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    names = ({f.split("/")[0] for f in listed.stdout.split("\0") if f} if listed.returncode == 0
             else {p.name for p in REPO.iterdir() if p.name not in ("runs", ".git")})
    for name in sorted(names):
        if (REPO / name).exists() and not (root / name).exists():
            (root / name).symlink_to(REPO / name)
    return root


def _driver(page_name: str, runnable: list[Snippet], root: Path) -> str:
    """A script that runs ``runnable`` in order in one namespace, from the repository root
    ``root`` as ``python`` started there would, each one compiled with the page's name and line
    numbers."""
    blocks = [(s.line, s.source) for s in runnable]
    return (f"import os, sys\n"
            f"sys.path[0] = {str(root)!r}\n"          # as for ``python`` started in the root
            f"os.chdir({str(root)!r})\n"
            f"namespace = {{'__name__': '__main__'}}\n"
            f"for line, source in {blocks!r}:\n"
            f"    exec(compile('\\n' * (line - 1) + source, {page_name!r}, 'exec'), namespace)\n"
            f"    sys.stderr.flush()\n"
            f"    print({SEPARATOR!r}, flush=True)\n")


def run_problems(page: Path, found: list[Snippet], tmp_path: Path, timeout: int = PAGE_TIMEOUT_S) -> list[str]:
    """Run the page's runnable snippets in order in one process; what failed, or each stated
    output that differs from the printed one."""
    from tests.runs import python
    runnable = [s for s in found if s.imports_only is None]
    if not runnable:
        return []
    name = page.relative_to(REPO).as_posix() if page.is_relative_to(REPO) else str(page)
    driver = tmp_path / f"snippets_{page.stem}.py"
    driver.write_text(_driver(name, runnable, _fresh_root(tmp_path)), encoding="utf-8")
    out = python(str(driver), timeout=timeout)
    outputs = out.stdout.split(SEPARATOR + "\n")
    if out.returncode != 0:
        failed = runnable[len(outputs) - 1]
        return [f"{name}:{failed.line}: the snippet failed (exit code {out.returncode}):\n"
                f"{out.stderr[-3000:]}"]
    problems = []
    for snippet, printed in zip(runnable, outputs):
        stated = _stated_output(snippet.source)
        got = [x.rstrip() for x in printed.rstrip("\n").splitlines()][-len(stated):] if stated else []
        if stated and got != [x.rstrip() for x in stated]:
            problems.append(f"{name}:{snippet.line}: the snippet states it prints {stated}, it printed {got}")
    return problems


PAGES = [p for p in DOCS if snippets(p)]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_snippet_imports_and_runs_as_written(page, tmp_path):
    found = snippets(page)
    problems = [p for s in found for p in import_problems(s)]
    assert not problems, "\n".join(problems)
    problems = run_problems(page, found, tmp_path)
    assert not problems, "\n".join(problems)


BROKEN_PAGE = """# A page

In Python, from the repository root:

```python
from training.schedules import lr_multiplier
print(lr_multiplier)
```

Then the optimizer's groups:

<!-- snippet: imports-only: builds a 7B model -->

```python
from training.optim import param_groups
```
"""

GOOD_PAGE = """# A page

```python
from training.optim.schedules import lr_multiplier
import training.config.ds_config
from model import Transformer
import torch
print(callable(lr_multiplier), 1 + 1)
# True 2
```

```py
print(torch.__name__, Transformer.__name__)      # a name from the page's snippet before
# torch Transformer
```

<!-- snippet: imports-only: needs a GPU -->
```python
from training.optim.optimizers import param_groups
torch.cuda.synchronize()
```
"""


def test_a_snippet_importing_a_moved_module_or_a_missing_name_fails_the_check():
    page = REPO / "docs" / "page.md"
    found = snippets(page, BROKEN_PAGE)
    assert [s.imports_only for s in found] == [None, "builds a 7B model"]
    problems = [p for s in found for p in import_problems(s)]
    assert len(problems) == 2, problems
    assert "docs/page.md:6: no module training.schedules" in problems[0]
    assert "docs/page.md:15: training.optim (training/optim/__init__.py) has no param_groups" in problems[1]
    good = snippets(page, GOOD_PAGE)
    assert [s.imports_only for s in good] == [None, None, "needs a GPU"]
    assert [p for s in good for p in import_problems(s)] == []


def test_a_failing_snippet_or_a_wrong_stated_output_fails_the_page(tmp_path):
    page = tmp_path / "page.md"
    assert run_problems(page, snippets(page, GOOD_PAGE), tmp_path) == []
    wrong = GOOD_PAGE.replace("# True 2", "# True 3")
    found = run_problems(page, snippets(page, wrong), tmp_path)
    assert len(found) == 1 and "states it prints ['True 3'], it printed ['True 2']" in found[0], found
    failing = snippets(page, BROKEN_PAGE)
    found = run_problems(page, failing, tmp_path)
    assert len(found) == 1 and ":6: the snippet failed" in found[0] and "training.schedules" in found[0], found
