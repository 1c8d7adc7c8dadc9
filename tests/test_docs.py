"""The README and docs say only what exists: every command in a fenced block runs as written
(parsed by the entry point's own argument parser, the trainer's up-front validation, or a launch
script's ``--dry-run``), every link and repository path they name exists, every topic page is
there, and no placeholder is left.

Commands are checked without running the long work: a Python entry point is executed with its
``ArgumentParser.parse_args`` cut short right after parsing (a bad option is argparse's exit 2);
``launch/train.py`` lines also go through ``train.prepare`` (recipe, DeepSpeed JSON, layout,
data source: everything validated before a process starts); ``estimate_memory.py`` lines run
whole (seconds); launch scripts run with ``--dry-run`` against a fake hostfile and SLURM.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.test_launch_scripts import _hostfile, _slurm_env

REPO = Path(__file__).resolve().parents[1]
TOPIC_PAGES = [
    "gpu-memory", "memory-estimation", "data-parallelism", "tensor-parallelism",
    "pipeline-parallelism", "zero-and-fsdp", "activation-checkpointing", "mixed-precision",
    "communication", "checkpoints", "lr-schedules", "batch-size-and-lamb", "weight-decay",
    "accumulation", "stability", "hyperparameters", "dense-vs-sparse", "routers-and-top-k",
    "load-balancing", "expert-parallelism", "switch", "mixtral", "modern-moe"]
DOCS = sorted([REPO / "README.md", REPO / "ds_configs" / "README.md",
               REPO / "benchmarks" / "README.md", *(REPO / "docs").glob("*.md")])
# Example paths a reader substitutes with their own: commands naming them are parsed, not run.
EXAMPLE_PATHS = re.compile(r"^(my|your|new|some)[\w.-]*$|^(init|hf|path/to)/|^runs/|\.txt$|^hostfile$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.\w+)?$|\.\.\.")
PATH_TOKEN = re.compile(r"`((?:model|training|planning|interop|launch|tests|benchmarks|ds_configs|"
                        r"recipes|docs)/[\w./*-]*)`")


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


class _Parsed(Exception):
    def __init__(self, namespace):
        super().__init__()
        self.namespace = namespace


def _parse_with_entry_point(monkeypatch, script: str, argv: list[str]):
    """Run ``script`` as __main__ until its parser returns; the parsed namespace, or SystemExit."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    try:
        runpy.run_path(str(REPO / script), run_name="__main__")
    except _Parsed as done:
        return done.namespace
    raise AssertionError(f"{script} finished without parsing its arguments")


def _strip_optional(line: str) -> str:
    while re.search(r"\s\[[^\[\]]*\]", line):
        line = re.sub(r"\s\[[^\[\]]*\]", "", line)
    return line


def _check_python(monkeypatch, tmp_path, script: str, args: list[str], env: dict) -> None:
    assert (REPO / script).is_file(), f"{script} does not exist"
    if any(PLACEHOLDER.search(a) for a in args):            # a synopsis line: its --help works
        with pytest.raises(SystemExit) as done:
            _parse_with_entry_point(monkeypatch, script, ["--help"])
        assert done.value.code == 0
        return
    namespace = _parse_with_entry_point(monkeypatch, script, args)
    monkeypatch.undo()
    paths = [getattr(namespace, k) for k in ("config", "recipe", "init_from", "text_file", "hf")
             if isinstance(getattr(namespace, k, None), (str, Path))]
    missing = [str(p) for p in paths if not (REPO / p).exists()]
    assert all(EXAMPLE_PATHS.search(p) for p in missing), f"{script}: no such file {missing}"
    if missing:
        return
    if script == "launch/train.py":                          # the trainer's full up-front check
        from launch import train
        monkeypatch.setenv("WORLD_SIZE", env.get("WORLD_SIZE", "1"))
        namespace.run_dir = str(tmp_path / "run")
        try:
            train.prepare(namespace)
        except ValueError as err:      # real-scale recipes read the user's corpus: check the rest
            if not str(err).startswith("data.source entry"):
                raise
            namespace.set = [*namespace.set, "data.source=stdlib"]
            train.prepare(namespace)
    elif script == "launch/estimate_memory.py":
        from launch import estimate_memory
        assert estimate_memory.main(args) == 0


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


@pytest.mark.parametrize("doc,line", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_documented_command_runs_as_written(monkeypatch, tmp_path, doc, line):
    words = shlex.split(_strip_optional(line))
    env = {}
    while re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    tool, rest = words[0], words[1:]
    if tool == "pip":
        if "-r" in rest:
            assert (REPO / rest[rest.index("-r") + 1]).is_file()
        return
    if tool == "pytest" or rest[:2] == ["-m", "pytest"]:
        assert all((REPO / a).exists() for a in rest if not a.startswith("-") and a not in ("-m", "pytest"))
        return
    if tool in ("deepspeed", "torchrun"):
        cut = next(i for i, w in enumerate(rest) if w.endswith(".py"))
        for flag in ("--num_gpus", "--nproc_per_node"):
            if flag in rest[:cut]:
                env["WORLD_SIZE"] = rest[rest.index(flag) + 1]
        _check_python(monkeypatch, tmp_path, rest[cut], rest[cut + 1:], env)
    elif tool == "python":
        if rest[0] == "-m":
            import importlib.util
            assert importlib.util.find_spec(rest[1]) is not None, rest[1]
            return
        _check_python(monkeypatch, tmp_path, rest[0], rest[1:], env)
    else:
        script, args = (rest[0], rest[1:]) if tool in ("bash", "sbatch") else (tool, rest)
        _check_shell(tmp_path, script, args, env)


def test_every_topic_page_exists_and_is_linked_from_the_index():
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    for name in TOPIC_PAGES:
        assert (REPO / "docs" / f"{name}.md").is_file(), f"docs/{name}.md is missing"
        assert f"({name}.md)" in index, f"docs/README.md does not link {name}.md"


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(REPO).as_posix() for d in DOCS])
def test_links_and_paths_exist(doc):
    text = doc.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.name}: link to missing {target}"
    for token in PATH_TOKEN.findall(text):
        assert glob.glob(str(REPO / token.rstrip("/"))), f"{doc.name}: `{token}` does not exist"


def test_no_placeholders_and_a_short_readme():
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        found = re.findall(r"\b(?:TEST_TIME|TEST_COUNT|TEST_WALL|TODO|TBD|FIXME|XXX)\b", text)
        assert not found, f"{doc.relative_to(REPO)}: placeholder {found}"
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) < 250
