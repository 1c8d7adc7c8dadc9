"""The README and docs say only what exists.

Every command in a fenced block of the README, ``ds_configs/README.md``, ``benchmarks/README.md``
and every page under ``docs/`` (``docs/studies/``, ``docs/performance/`` included) is checked as
written. ``python -m module`` of a module of this repository (``python -m
benchmarks.systems.comm_volume``) is checked as ``python script`` is: the module's own parser
reads the line; ``python -m torch.distributed.run`` as ``torchrun``; ``python -m pytest`` as
``pytest``; any other module must be installed. Those that finish in seconds on a CPU run whole:

- ``launch/estimate_memory.py`` lines (the whole estimate or plan);
- the launch scripts, with ``--dry-run`` against a fake hostfile and SLURM;
- the commands that read a finished run (``evaluate.py``, ``convert_hf.py export``,
  ``analyze_router.py``) on a 2-step tiny Mixtral run standing in for ``runs/tiny-mixtral``, with
  their outputs sent to a temporary folder;
- a ``launch/train.py`` line the trainer refuses on a CPU (fp16 without a GPU): exit code 2 and
  one ``error:`` line;
- the benchmarks in ``QUICK_BENCHMARKS``;
- ``pytest`` lines (the suite runs those tests): every named file and ``::test`` exists, and every
  word of a ``-k`` names part of a test;
- synopsis lines with placeholders (``DS_JSON``): the entry point's ``--help``.

The Python ones run on a process forked from the warm launcher's server (``tests.runs.python``:
the same command line and working directory, the libraries imported once). A command written the
same way on several pages runs once. The rest (training runs,
``to_universal.py``, the other benchmarks and the studies: a minute to hours each; commands that
need an HF checkpoint or a trained dense run) are parsed only: the entry point's own
argument parser reads the line (an option it lacks fails the test), and a ``launch/train.py`` line
also goes through ``preflight.prepare``, the trainer's whole up-front validation (recipe, DeepSpeed
JSON, layout, data source). ``docs/README.md`` states the same rule for readers.

Every link resolves, to a file that exists and, for ``page.md#anchor``, to a heading of that page
(GitHub's anchor rule); every repository path named in backquotes exists; no placeholder is left;
every page under ``docs/`` is reachable by links from ``docs/README.md``.

The Python snippets of the pages: ``tests/test_doc_snippets.py``; the rank order and the
data-parallel degree wherever stated: ``tests/test_doc_formulas.py``; code names tied to files:
``tests/test_doc_pointers.py``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.test_launch_scripts import _hostfile, _slurm_env
from tests.runs import SMALL, python
from tests.runs import env as _run_env

REPO = Path(__file__).resolve().parents[1]
TOPIC_PAGES = [
    "gpu", "gpu-memory", "memory-estimation", "data-parallelism", "tensor-parallelism",
    "pipeline-parallelism", "zero-and-fsdp", "activation-checkpointing", "mixed-precision",
    "communication", "checkpoints", "lr-schedules", "batch-size-and-lamb", "weight-decay",
    "accumulation", "stability", "hyperparameters", "dense-vs-sparse", "routers-and-top-k",
    "load-balancing", "expert-parallelism", "switch", "mixtral", "modern-moe", "data", "planning"]
DOCS = sorted([REPO / "README.md", REPO / "ds_configs" / "README.md",
               REPO / "benchmarks" / "README.md", *(REPO / "docs").rglob("*.md")])
# Example paths a reader substitutes with their own: commands naming them are parsed, not run.
EXAMPLE_PATHS = re.compile(r"^(my|your|new|some)[\w.-]*$|^(init|hf|path/to)/|^runs/|\.txt$|^hostfile$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.\w+)?$|\.\.\.")
PATH_TOKEN = re.compile(r"`((?:model|training|planning|interop|launch|tests|benchmarks|ds_configs|"
                        r"recipes|docs)/[\w./*-]*)`")
# The commands that read a finished run, run on a tiny one standing in for the documented run.
RUN_READERS = {"launch/evaluate.py", "launch/convert_hf.py", "launch/analyze_router.py"}
DOCUMENTED_RUN = "runs/tiny-mixtral"
# Benchmarks that finish in seconds on 2 CPU cores: run whole, as written (a module, as
# ``python -m`` names it, or a kept path entry point).
QUICK_BENCHMARKS = {"benchmarks.systems.comm_volume", "benchmarks/planner_vs_published.py",
                    "benchmarks.peers.planner_vs_published"}
# ``python -m`` of these launches a script as torchrun does: the script's line is checked.
LAUNCHER_MODULES = {"torch.distributed.run", "deepspeed.launcher.runner"}
_PASSED: set[tuple] = set()          # commands already run whole in this session, as written


def _fenced_commands(path: Path) -> list[str]:
    lines = []
    for block in re.findall(r"^```[\w-]*\n(.*?)^```", path.read_text(encoding="utf-8"), re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            words = line.split()
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words = words[1:]
            if words and (words[0] in ("python", "deepspeed", "torchrun", "bash", "sbatch", "pytest", "pip")
                          or words[0].startswith("launch/")):
                lines.append(line)
    return lines


COMMANDS = [(p.relative_to(REPO).as_posix(), c) for p in DOCS for c in _fenced_commands(p)]


# ----------------------------------------------------------------------------- commands


class _Parsed(Exception):
    def __init__(self, namespace):
        super().__init__()
        self.namespace = namespace


def _is_module(entry: str) -> bool:
    """``entry`` names a module (``benchmarks.systems.comm_volume``), not a script path."""
    return not entry.endswith((".py", ".sh", ".sbatch")) and "/" not in entry


def _repo_module(name: str) -> Path | None:
    """The file ``python -m name`` runs when ``name`` is a module of this repository (its top
    package is a folder here), or None for any other module."""
    parts = name.split(".")
    if not (REPO / parts[0] / "__init__.py").is_file():
        return None
    path = REPO.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__main__.py"):
        if candidate.is_file():
            return candidate
    raise AssertionError(f"python -m {name}: no module {'/'.join(parts)}.py in the repository")


def _parse_with_entry_point(monkeypatch, script: str, argv: list[str]):
    """Run ``script`` (a path, or a module as ``python -m`` names it) as __main__ until its
    parser returns; the parsed namespace, or SystemExit."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        self.allow_abbrev = False         # a documented flag is spelled out, not a prefix of one
        for sub in self._subparsers._group_actions if self._subparsers else ():
            for parser in sub.choices.values():
                parser.allow_abbrev = False
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    module = _repo_module(script) if _is_module(script) else None
    monkeypatch.setattr(sys, "argv", [str(module or script), *argv])
    if module is not None:                          # not yet imported, as in a fresh ``python -m``
        monkeypatch.delitem(sys.modules, script, raising=False)
    try:
        if module is not None:                      # as ``python -m script`` from the root
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(REPO / script), run_name="__main__")
    except _Parsed as done:
        return done.namespace
    finally:
        monkeypatch.undo()
    raise AssertionError(f"{script} finished without parsing its arguments")


def _strip_optional(line: str) -> str:
    while re.search(r"\s\[[^\[\]]*\]", line):
        line = re.sub(r"\s\[[^\[\]]*\]", "", line)
    return line


def _run(argv: list[str], timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=_run_env(), capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """A tiny Mixtral run (the default recipe at test size, fp32 ZeRO-1, 2 steps, one checkpoint):
    what ``runs/tiny-mixtral`` is to the commands that read a run."""
    run = tmp_path_factory.mktemp("docs") / "tiny-mixtral"
    out = python("launch/train.py", "--config", "ds_configs/zero1_fp32.json", "--run-dir", str(run),
                 "--steps", "2", "--set", *SMALL, "eval.every=0",
                 "model.moe.router_jitter=0")         # HF Mixtral has no router-only jitter
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def _run_reader(script: str, args: list[str], tmp_path: Path, finished: Path) -> None:
    """``script`` as written, on a copy of ``finished`` in place of the documented run; its text
    file a few KB of real text, its output folder in ``tmp_path``."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    text = tmp_path / "text.txt"
    text.write_text((Path(shutil.__file__)).read_text(encoding="utf-8")[:20000], encoding="utf-8")
    swapped, value_of = [], None
    for word in args:
        if value_of == "--run-dir" or (value_of == "--out" and word.startswith(DOCUMENTED_RUN)):
            word = word.replace(DOCUMENTED_RUN, str(run), 1)
        elif value_of == "--out":
            word = str(tmp_path / "out")
        elif value_of == "--text-file":
            word = str(text)
        swapped.append(word)
        value_of = word if word.startswith("--") else None
    out = python(script, *swapped)
    assert out.returncode == 0, f"{script} {swapped}: {out.stderr[-3000:]}"


def _check_python(monkeypatch, tmp_path, script: str, args: list[str], env: dict, finished) -> None:
    """``python script args`` (``script`` a path), or ``python -m script args`` (``script`` a
    module of this repository), checked alike."""
    if _is_module(script):
        _repo_module(script)                                 # the module exists
    else:
        assert (REPO / script).is_file(), f"{script} does not exist"
    if any(PLACEHOLDER.search(a) for a in args):            # a synopsis line: its --help works
        with pytest.raises(SystemExit) as done:
            _parse_with_entry_point(monkeypatch, script, ["--help"])
        assert done.value.code == 0
        return
    namespace = _parse_with_entry_point(monkeypatch, script, args)
    if (script, *args) in _PASSED:
        return
    if script in QUICK_BENCHMARKS:
        out = python(*(["-m", script] if _is_module(script) else [script]), *args)
        assert out.returncode == 0, f"{script} {args}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
        _PASSED.add((script, *args))
        return
    if script in RUN_READERS and getattr(namespace, "run_dir", None) is not None \
            and str(namespace.run_dir) == DOCUMENTED_RUN:
        _run_reader(script, args, tmp_path, finished())
        _PASSED.add((script, *args))
        return
    paths = [getattr(namespace, k) for k in ("config", "recipe", "init_from", "text_file", "hf")
             if isinstance(getattr(namespace, k, None), (str, Path))]
    missing = [str(p) for p in paths if not (REPO / p).exists()]
    assert all(EXAMPLE_PATHS.search(p) for p in missing), f"{script}: no such file {missing}"
    if missing:
        return
    if script == "launch/train.py":                          # the trainer's full up-front check
        from training.run.preflight import prepare
        monkeypatch.setenv("WORLD_SIZE", env.get("WORLD_SIZE", "1"))
        namespace.run_dir = str(tmp_path / "run")
        try:
            prepare(namespace)
        except ValueError as err:
            message = str(err)
            if message.startswith("data.source entry"):    # a real-scale recipe's own corpus
                namespace.set = [*namespace.set, "data.source=stdlib"]
                prepare(namespace)
            elif message.startswith("fp16.enabled") and "needs a GPU" in message:
                _check_refused_on_cpu(args, tmp_path)     # documented as refused here
            else:
                raise
        finally:
            monkeypatch.undo()
    elif script == "launch/estimate_memory.py":
        from launch import estimate_memory
        assert estimate_memory.main(args) == 0


def _check_refused_on_cpu(args: list[str], tmp_path: Path) -> None:
    """The trainer as written: exit code 2, one ``error:`` line, no traceback, nothing written."""
    run_dir = tmp_path / "refused"
    out = python("launch/train.py", *args, "--run-dir", str(run_dir))
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert [x for x in out.stderr.splitlines() if x.startswith("error:")] == [out.stderr.strip().splitlines()[-1]]
    assert not run_dir.exists()


def _check_shell(tmp_path, script: str, args: list[str], env: dict) -> None:
    assert (REPO / script).is_file(), f"{script} does not exist"
    if script.endswith(".sbatch"):
        env = {**env, **_slurm_env(tmp_path)}
    if not script.startswith("launch/"):                    # not a launcher: its syntax parses
        proc = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return
    nodes = 8 if "8x8" in script else 2
    args = [_hostfile(tmp_path, nodes) if a == "hostfile" else a for a in args]
    if "--dry-run" not in args:
        args = ["--dry-run", *args]
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(REPO / script), *args], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{script} {args}: {proc.stderr.strip()}"


def _check_pytest(args: list[str]) -> None:
    """Not run here (the suite runs them): every named file exists, every ``::name`` is a test in
    it, and every word of a ``-k`` expression names part of a test in the files."""
    files, keyword = [], None
    for i, a in enumerate(args):
        if a.startswith("-k"):
            keyword = a[2:] or args[i + 1]
        elif not a.startswith("-") and not (i and args[i - 1] == "-k"):
            files.append(a)
    tests = []
    for spec in files or ["tests"]:
        path, _, name = spec.partition("::")
        assert (REPO / path).exists(), f"pytest: no such file {path}"
        sources = [REPO / path] if (REPO / path).is_file() else (REPO / path).rglob("test_*.py")
        found = [t for src in sources for t in re.findall(r"^(?:async )?def (test_\w+)", src.read_text(), re.M)]
        assert not name or name.split("[")[0] in found, f"pytest: {path} has no test {name}"
        tests += found
    for word in re.findall(r"\w+", keyword or ""):
        if word not in ("and", "or", "not"):
            assert any(word.lower() in t.lower() for t in tests), f"pytest -k {keyword}: no test matches {word}"


def _check_command(monkeypatch, tmp_path, line: str, finished) -> None:
    words = shlex.split(_strip_optional(line))
    env = {}
    while re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    tool, rest = words[0], words[1:]
    if tool == "pip":
        if "-r" in rest:
            assert (REPO / rest[rest.index("-r") + 1]).is_file()
        pinned = [w.split("==", 1)[1] for w in rest if w.startswith("torch==")]
        ci = re.search(r"torch==([\w.+]+)", (REPO / ".ci" / "run").read_text()).group(1)
        assert all(v == ci for v in pinned), f"pip pins torch {pinned}, .ci/run installs {ci}"
        return
    if tool == "pytest" or rest[:2] == ["-m", "pytest"]:
        _check_pytest([a for a in rest if a not in ("-m", "pytest")])
        return
    if tool == "python" and rest[:1] == ["-m"] and rest[1] in LAUNCHER_MODULES:
        tool, rest = "torchrun", rest[2:]                      # ``python -m torch.distributed.run``
    if tool in ("deepspeed", "torchrun"):
        cut = next(i for i, w in enumerate(rest) if w.endswith(".py") or w == "-m")
        for flag in ("--num_gpus", "--nproc_per_node"):
            if flag in rest[:cut]:
                env["WORLD_SIZE"] = rest[rest.index(flag) + 1]
        if rest[cut] == "-m":                                  # the launcher's ``-m module``
            cut += 1
        _check_python(monkeypatch, tmp_path, rest[cut], rest[cut + 1:], env, finished)
    elif tool == "python":
        if rest[0] == "-m" and _repo_module(rest[1]) is None:
            import importlib.util
            assert importlib.util.find_spec(rest[1]) is not None, rest[1]
        elif rest[0] == "-m":                                # a module of this repository
            _check_python(monkeypatch, tmp_path, rest[1], rest[2:], env, finished)
        else:
            _check_python(monkeypatch, tmp_path, rest[0], rest[1:], env, finished)
    else:
        if tool == "sbatch":                                 # sbatch's own options first
            rest = [a for i, a in enumerate(rest) if not all(b.startswith("-") for b in rest[:i + 1])]
        script, args = (rest[0], rest[1:]) if tool in ("bash", "sbatch") else (tool, rest)
        _check_shell(tmp_path, script, args, env)


@pytest.mark.parametrize("doc,line", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_documented_command_runs_as_written(monkeypatch, tmp_path, request, doc, line):
    _check_command(monkeypatch, tmp_path, line, lambda: request.getfixturevalue("finished_run"))


@pytest.mark.parametrize("line", [
    "python launch/estimate_memory.py --recipe recipes/tiny_mixtral.yaml --gpus 8 --no-such-flag",
    "python benchmarks/pipeline_schedules.py --micro-batches 2 --no-such-flag",
    "python -m benchmarks.systems.comm_volume --no-such-flag",
    "python -m benchmarks.peers.moe_layer --threads 1 --time cpu",        # a prefix of --timer
    "python -m benchmarks.systems.no_such_benchmark",
    "python -m torch.distributed.run --nproc_per_node 8 -m benchmarks.gpu.nccl_check --no-such-flag",
    "deepspeed launch/train.py --config ds_configs/zero3.json --stepz 5",
    "deepspeed launch/train.py --config ds_configs/zero3.json --step 5",     # a prefix of --steps
    "python launch/convert_hf.py export --run-dir runs/tiny-mixtral --out hf/x --no-such-flag",
    "pytest tests/launch/test_train.py -k no_test_has_this_name",
    "pytest tests/no_such_file.py",
])
def test_a_documented_command_with_a_removed_flag_or_test_fails_the_check(monkeypatch, tmp_path, line):
    with pytest.raises((SystemExit, AssertionError)):
        _check_command(monkeypatch, tmp_path, line, lambda: pytest.fail("no run needed"))


def test_every_topic_page_exists_and_is_linked_from_the_index():
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    for name in TOPIC_PAGES:
        assert (REPO / "docs" / f"{name}.md").is_file(), f"docs/{name}.md is missing"
        assert f"({name}.md)" in index, f"docs/README.md does not link {name}.md"
    for study in (REPO / "docs" / "studies").glob("*.md"):
        assert study in DOCS and f"(studies/{study.name})" in index, f"{study.name} unchecked or unlinked"


def _linked_pages(doc: Path) -> set[Path]:
    out = set()
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(doc.read_text(encoding="utf-8"))):
        file = target.partition("#")[0]
        if file.endswith(".md") and not re.match(r"^[a-z]+:", file) and (doc.parent / file).is_file():
            out.add((doc.parent / file).resolve())
    return out


def test_topic_page_index_reaches_every_page():
    """A reader who starts at docs/README.md can reach every page under docs/ (a page: a file
    that opens with a ``# `` title; a study's generated table is not one) by following links."""
    seen, todo = set(), [(REPO / "docs" / "README.md").resolve()]
    while todo:
        page = todo.pop()
        if page not in seen:
            seen.add(page)
            todo += _linked_pages(page) - seen
    pages = {p.resolve() for p in (REPO / "docs").rglob("*.md")
             if p.read_text(encoding="utf-8").startswith("# ")}
    assert sorted(p.relative_to(REPO).as_posix() for p in pages - seen) == []


# ----------------------------------------------------------------------------- links and anchors


def _without_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped, lowercase,
    spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", _without_code(page.read_text(encoding="utf-8")), re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _link_problems(doc: Path) -> list[str]:
    """Every relative link of ``doc`` that names a missing file or a missing heading."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(doc.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            problems.append(f"{doc.name}: link to missing {target}")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            problems.append(f"{doc.name}: link to {target}, a heading {path.name} does not have")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(REPO).as_posix() for d in DOCS])
def test_links_anchors_and_paths_exist(doc):
    assert _link_problems(doc) == []
    for token in PATH_TOKEN.findall(doc.read_text(encoding="utf-8")):
        assert glob.glob(str(REPO / token.rstrip("/"))), f"{doc.name}: `{token}` does not exist"


def test_a_broken_anchor_or_a_missing_file_fails_the_link_check(tmp_path):
    studies = tmp_path / "docs" / "studies"
    studies.mkdir(parents=True)
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Measured: `x` (CPU, 2 ranks)\n\ntext\n")
    (studies / "img").mkdir()
    (studies / "img" / "plot.png").write_bytes(b"png")
    good = studies / "good.md"
    good.write_text("# Study\n\n![plot](img/plot.png) [page](../page.md#measured-x-cpu-2-ranks) "
                    "[here](#study)\n\n```bash\n# not a heading\n```\n")
    assert _link_problems(good) == []
    for text, problem in [("![plot](img/missing.png)", "missing img/missing.png"),
                          ("[page](../page.md#no-such-heading)", "does not have"),
                          ("[here](#not-a-heading)", "does not have"),
                          ("[gone](../gone.md)", "missing ../gone.md")]:
        bad = studies / "bad.md"
        bad.write_text(f"# Study\n\n{text}\n\n```bash\n# not-a-heading\n```\n")
        assert [p for p in _link_problems(bad) if problem in p], text


def test_no_placeholders_and_a_short_readme():
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        found = re.findall(r"\b(?:TEST_TIME|TEST_COUNT|TEST_WALL|TODO|TBD|FIXME|XXX)\b", text)
        assert not found, f"{doc.relative_to(REPO)}: placeholder {found}"
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) < 250
