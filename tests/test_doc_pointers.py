"""The docs' pointers into the code name what the code defines, so that moving a function cannot
leave a page pointing at its old home.

A pointer is a code name in backquotes tied to a file of this repository:

- a dotted name into a package, ``training.run.trainer.Run`` (``model.<key>`` is also how recipe
  keys are written, so ``model.`` names are checked only when they reach a module file);
- a name before a file: `` `resolve_ds_config` in [training/config/ds_config.py](...) ``, also
  `` `name` ([file](...)) `` and `` `name` in `file` ``;
- the names that open the text after a file: `` [file](...): `A`, `B.c` and `D` `` (a
  parenthetical between them is skipped), also `` `file` `name` ``;
- in a table row whose last cell is one file link, the code-like names of the first cell (with an
  underscore, a dot, a capital or ``()``).

``Class.member`` must be a member of that class; a bare name must be defined anywhere in the file
(a function, class, assignment or attribute assignment, or an import).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.test_docs import DOCS, REPO

PACKAGES = ("model", "training", "planning", "interop", "analysis", "launch", "data_pipeline", "benchmarks")
LIBRARIES = ("deepspeed", "torch", "transformers", "np", "numpy", "os", "sys", "json", "safetensors",
             "wandb", "datasets", "tokenizers", "pyarrow", "megatron", "triton", "engine")
IDENT = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
NAME = re.compile(rf"`({IDENT})(?:\(\))?`")
FILE_REF = re.compile(r"\[[^\]]*\]\(((?:\.\./)*[\w./-]+\.py)\)|`((?:%s)/[\w./-]+\.py)`" % "|".join(PACKAGES))
_DEFINED: dict[Path, tuple[set, set, dict]] = {}


def _targets(node) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {n.id if isinstance(n, ast.Name) else n.attr for t in targets for n in ast.walk(t)
            if isinstance(n, (ast.Name, ast.Attribute))}


def _names(node) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        return _targets(node)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return set()


def defined(path: Path) -> tuple[set[str], set[str], dict[str, set[str]]]:
    """The names ``path`` defines anywhere, at its top level, and each class's member names."""
    if path not in _DEFINED:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        anywhere = set().union(*(_names(n) for n in ast.walk(tree)))
        top = set().union(*(_names(n) for n in tree.body))
        members = {n.name: set().union(*(_names(m) for m in ast.walk(n)))
                   for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        _DEFINED[path] = anywhere, top, members
    return _DEFINED[path]


def missing(path: Path, name: str, top_level: bool = False) -> bool:
    anywhere, top, members = defined(path)
    head, *rest = name.split(".")
    return (head not in (top if top_level else anywhere)
            or bool(rest and head in members and rest[0] not in members[head]))


def _dotted(name: str) -> str | None:
    """Why the dotted ``package.module.name`` does not resolve, or None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = REPO.joinpath(*parts[:i]).with_suffix(".py")
        if module.is_file():
            rest = ".".join(parts[i:])
            return (f"{module.relative_to(REPO)} defines no {rest}"
                    if rest and missing(module, rest, top_level=True) else None)
    return None if parts[0] == "model" else "no such module"


def _file(doc: Path, ref: re.Match) -> Path:
    return (doc.parent / ref.group(1)).resolve() if ref.group(1) else REPO / ref.group(2)


def pointer_problems(doc: Path, text: str | None = None) -> list[str]:
    """Every pointer of ``doc`` (or of ``text``, read as if it were ``doc``) that names nothing."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8") if text is None else text,
                  flags=re.M | re.S)
    out = []
    for name in NAME.findall(text):
        if "." in name and name.split(".")[0] in PACKAGES and not re.search(
                r"\.(py|json|md|png|yaml|txt|safetensors)$", name) and (why := _dotted(name)):
            out.append(f"`{name}`: {why}")
    checks = []                                     # (name, file) pairs tied by their position
    for para in re.split(r"\n\s*\n|\n(?=\s*[-*] |\s*\d+\. |\|)", text):
        refs = list(FILE_REF.finditer(para))
        for i, ref in enumerate(refs):
            before = para[:ref.start()]
            lead = re.search(rf"`{IDENT}(?:\(\))?`(?:,? and `{IDENT}(?:\(\))?`)*\s+(?:in\s+|\(|of\s+)$", before)
            if lead:
                checks += [(n, _file(doc, ref)) for n in NAME.findall(before[lead.start():])]
            after = para[ref.end():refs[i + 1].start() if i + 1 < len(refs) else len(para)]
            lead = re.match(rf"(?::\s*|\s+)`{IDENT}(?:\(\))?`(?:(?:\s*\([^)]*\))?(?:,\s*|,?\s+and\s+)"
                            rf"`{IDENT}(?:\(\))?`)*", after)
            if lead:
                checks += [(n, _file(doc, ref)) for n in NAME.findall(re.sub(r"\([^)]*\)", "", lead.group(0)))]
    for row in re.findall(r"^\|(.+)\|\s*$", text, re.M):
        cells = [c.strip() for c in row.split("|")]
        refs = list(FILE_REF.finditer(cells[-1]))
        if len(cells) > 1 and len(refs) == 1 and not FILE_REF.sub("", cells[-1]).strip(" ,;"):
            checks += [(n, _file(doc, refs[0])) for n in NAME.findall(cells[0]) if re.search(r"[_.A-Z]", n)]
    for name, path in checks:
        if path.is_file() and not ("." in name and name.split(".")[0] in PACKAGES + LIBRARIES) \
                and missing(path, name):
            out.append(f"`{name}` beside {path.relative_to(REPO)}: not defined there")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(REPO).as_posix() for d in DOCS])
def test_every_pointer_names_what_the_code_defines(doc):
    assert pointer_problems(doc) == []


def test_a_pointer_to_a_moved_or_renamed_name_fails_the_check():
    doc = REPO / "docs" / "page.md"              # links are read relative to docs/
    good = ("The loop is `Run.loop` in [training/run/trainer.py](../training/run/trainer.py); "
            "[training/step/stepper.py](../training/step/stepper.py): `Stepper.train_step`, "
            "`_prepare_last_step` (lr 0) and `_finish_step`. `training.config.ds_config.resolve_ds_config` "
            "checks it; `model.moe.top_k` is a recipe key.\n\n"
            "| `plan_dispatch`, `permute` | [model/moe/dispatcher.py](../model/moe/dispatcher.py) |\n")
    assert pointer_problems(doc, good) == []
    for bad, problem in [
            ("`resolve_ds_config` in [training/run/trainer.py](../training/run/trainer.py)", "resolve_ds_config"),
            ("[training/step/stepper.py](../training/step/stepper.py): `SpikeMonitor`, `Stepper`", "SpikeMonitor"),
            ("[training/step/stepper.py](../training/step/stepper.py): `Stepper.no_such_method`", "no_such_method"),
            ("`training.run.setup.build_model` builds it", "no such module"),
            ("`training.run.trainer.build_stepper` builds it", "defines no build_stepper"),
            ("`check_precision` (`training/step/stats.py`)", "check_precision"),
            ("| `plan_dispatch`, `kept_rows` | [model/moe/dispatcher.py](../model/moe/dispatcher.py) |", "kept_rows")]:
        found = pointer_problems(doc, bad + "\n")
        assert found and problem in found[0], (bad, found)
