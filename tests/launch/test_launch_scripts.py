"""Launch scripts (launch/*.sh, launch/slurm_8x8.sbatch): each ``--dry-run`` prints one command
that its launcher's own parser and ``launch/train.py``'s parser accept, with the cluster shape the
script is named for. Nothing is launched: the scripts run under bash, with a fake hostfile, fake
SLURM variables and a fake ``scontrol`` (or ``deepspeed``) on PATH where they need one.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser as torchrun_args_parser

from launch.train import parse_args as train_parse_args


def _deepspeed_parse_args(argv):
    """DeepSpeed's own launcher parser (imported here: collecting this file needs no deepspeed)."""
    from deepspeed.launcher.runner import parse_args
    return parse_args(argv)


REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ("cpu_local.sh", "gpu_1.sh", "node_8gpu.sh", "multinode_hostfile.sh", "multinode_8x8.sh",
           "slurm_8x8.sbatch")
RECIPE, CONFIG = "recipes/tiny_mixtral.yaml", "ds_configs/zero3.json"
# Pass-through arguments, with a space and a quote to prove the printed line is shell-quoted.
EXTRA = ["--steps", "5", "--run-dir", "runs/a b", "--set", "train.seed=1", "tracking.run_name=it's"]
JOB_ID = "4242"


def _fake_bin(tmp_path: Path, name: str, body: str) -> dict:
    """Put an executable `name` on PATH and return the env that sees it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/sh\n" + body)
    (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _hostfile(tmp_path: Path, nodes: int) -> str:
    path = tmp_path / f"hostfile{nodes}"
    path.write_text("# DeepSpeed hostfile\n" + "".join(f"gpu{i:02d} slots=8\n" for i in range(1, nodes + 1)))
    return str(path)


def _slurm_env(tmp_path: Path, nodes: int = 8) -> dict:
    hosts = " ".join(f"gpu{i:02d}" for i in range(1, nodes + 1))
    env = _fake_bin(tmp_path, "scontrol", f'[ "$1 $2" = "show hostnames" ] || exit 1\n'
                                          f'for h in {hosts}; do echo $h; done\n')
    return {**env, "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": f"gpu[01-{nodes:02d}]",
            "SLURM_NNODES": str(nodes), "SLURM_SUBMIT_DIR": str(REPO)}


def _run(script: str, *args: str, env: dict | None = None, cwd: Path = REPO,
         dry_run: bool = True) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "WANDB_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_"))
            and k not in ("MASTER_ADDR", "MASTER_PORT", "NPROC", "TORCH_CPP_LOG_LEVEL")}
    argv = ["bash", str(REPO / "launch" / script), *(["--dry-run"] if dry_run else []), *args]
    return subprocess.run(argv, cwd=cwd, env={**base, **(env or {})}, capture_output=True,
                          text=True, timeout=30)


def _dry_run_argv(script: str, *args: str, env: dict | None = None) -> list[str]:
    proc = _run(script, *args, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"one command line expected, got {proc.stdout!r}"
    return shlex.split(lines[0])


def _check_train_args(script_path: str, argv: list[str]) -> None:
    """(b) and (d): the trainer part names launch/train.py, CONFIG, RECIPE and parses."""
    assert script_path.endswith("launch/train.py")
    args = train_parse_args(argv)
    assert (args.config, args.recipe, args.steps, args.run_dir) == (CONFIG, RECIPE, 5, "runs/a b")
    assert args.set == ["train.seed=1", "tracking.run_name=it's"]


# (script, nodes, ranks per node, extra env); a hostfile and SLURM are faked for the scripts that need them.
CASES = [("cpu_local.sh", 1, 2, {}), ("cpu_local.sh", 1, 4, {"NPROC": "4", "PREEMPT_GRACE_S": "900"}),
         ("gpu_1.sh", 1, 1, {}),
         ("node_8gpu.sh", 1, 8, {}), ("multinode_hostfile.sh", 2, 8, {}), ("multinode_8x8.sh", 8, 8, {}),
         ("slurm_8x8.sbatch", 8, 8, {})]


@pytest.mark.parametrize("script,nodes,nproc,env", CASES,
                         ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_dry_run_prints_a_valid_command_with_the_cluster_shape(tmp_path, script, nodes, nproc, env):
    hostfile = [_hostfile(tmp_path, nodes)] if script.startswith("multinode") else []
    if script.endswith(".sbatch"):
        env = {**env, **_slurm_env(tmp_path, nodes)}
    argv = _dry_run_argv(script, *hostfile, RECIPE, CONFIG, *EXTRA, env=env)

    if argv[0] == "deepspeed":                                  # (a) launcher, (c) shape
        ds = _deepspeed_parse_args(argv[1:])
        assert ds.num_gpus == nproc
        if hostfile:
            assert (ds.hostfile, ds.num_nodes) == (hostfile[0], nodes)
        else:
            assert nodes == 1 and ds.num_nodes == -1            # -1: this machine only
        _check_train_args(ds.user_script, ds.user_args)
        return

    if script == "cpu_local.sh":
        assert argv[0] == "torchrun"
        torchrun_argv = argv[1:]
    else:                                                        # srun [srun flags] torchrun ...
        assert script == "slurm_8x8.sbatch" and argv[0] == "srun"
        cut = argv.index("torchrun")
        assert argv[1:cut] == ["--nodes", str(nodes), "--ntasks-per-node", "1", "--gpus-per-node",
                               str(nproc), "--kill-on-bad-exit=1"]
        torchrun_argv = argv[cut + 1:]
    tr = torchrun_args_parser().parse_args(torchrun_argv)
    assert (tr.nnodes, tr.nproc_per_node) == (str(nodes), str(nproc))
    # The preemption grace: SIGUSR1 forwarded like SIGTERM, the ranks waited for (the sbatch
    # script's --signal lead time; PREEMPT_GRACE_S overrides it).
    assert "SIGUSR1" in tr.signals_to_handle.split(",")
    assert tr.shutdown_timeout == int(env.get("PREEMPT_GRACE_S", 600))
    if script == "cpu_local.sh":
        assert tr.standalone
    else:  # rendezvous on the job's first node, the same command on every node
        assert (tr.rdzv_backend, tr.rdzv_endpoint, tr.rdzv_id) == ("c10d", "gpu01:29500", JOB_ID)
    _check_train_args(tr.training_script, tr.training_script_args)


def test_recipe_header_commands_are_what_the_scripts_run(tmp_path):
    """Every recipe's `deepspeed ... launch/train.py` line is the exact dry run of its script."""
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        header = "".join(l for l in recipe.read_text().splitlines(keepends=True) if l.startswith("#"))
        line = re.search(r"^#\s+(?:Launch: )?(deepspeed .*launch/train\.py .*)$", header, re.M).group(1)
        ds = _deepspeed_parse_args(shlex.split(line)[1:])
        env = {}
        if ds.hostfile == "hostfile":     # other node counts: multinode_hostfile.sh with NUM_NODES
            script = "multinode_8x8.sh" if ds.num_nodes == 8 else "multinode_hostfile.sh"
            env = {} if ds.num_nodes in (2, 8) else {"NUM_NODES": str(ds.num_nodes)}
            assert not env or f"NUM_NODES={ds.num_nodes} launch/{script}" in header, recipe.name
            prefix = [_hostfile(tmp_path, ds.num_nodes)]
        else:
            script, prefix = {1: "gpu_1.sh", 8: "node_8gpu.sh"}[ds.num_gpus], []
        train = train_parse_args(ds.user_args)
        out = _run(script, *prefix, train.recipe, train.config, env=env).stdout.strip()
        assert (out.replace(prefix[0], "hostfile") if prefix else out) == line, recipe.name
        named = re.findall(r"launch/(\w+\.sh)", header)
        assert set(named) <= {script}, f"{recipe.name} names {named}, its command is {script}'s"


@pytest.mark.parametrize("script,args,env,message", [
    ("gpu_1.sh", [], {}, "missing RECIPE CONFIG"),
    ("node_8gpu.sh", [RECIPE], {}, "missing CONFIG"),
    ("multinode_hostfile.sh", [RECIPE, CONFIG], {}, "missing CONFIG"),
    ("cpu_local.sh", ["--steps", "5", RECIPE, CONFIG], {}, "expected RECIPE, got option --steps"),
    ("gpu_1.sh", [RECIPE, CONFIG, "--config", CONFIG], {}, "as positional arguments"),
    ("gpu_1.sh", [RECIPE, "no_such.json"], {}, "no such file: no_such.json"),
    ("cpu_local.sh", [RECIPE, CONFIG], {"NPROC": "two"}, "must be a positive integer"),
    ("cpu_local.sh", [RECIPE, CONFIG], {"PREEMPT_GRACE_S": "10m"}, "PREEMPT_GRACE_S must be a whole number"),
    ("slurm_8x8.sbatch", [RECIPE, CONFIG], {}, "not inside a SLURM job"),
])
def test_bad_arguments_exit_2_with_a_usage_line(script, args, env, message):
    proc = _run(script, *args, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert message in proc.stderr, proc.stderr
    if message.startswith(("missing", "expected")):
        assert re.search(rf"^usage: launch/{re.escape(script)} \[--dry-run\] .*RECIPE CONFIG", proc.stderr,
                         re.M) or script.endswith(".sbatch"), proc.stderr


def test_cluster_mismatches_are_refused(tmp_path):
    proc = _run("multinode_8x8.sh", _hostfile(tmp_path, 2), RECIPE, CONFIG)
    assert proc.returncode == 2 and "lists 2 hosts, this script needs 8" in proc.stderr
    proc = _run("slurm_8x8.sbatch", RECIPE, CONFIG, env=_slurm_env(tmp_path, nodes=4))
    assert proc.returncode == 2 and "the job has 4 nodes, this script needs 8" in proc.stderr


def test_scripts_are_short_executable_and_documented():
    for name in SCRIPTS:
        path = REPO / "launch" / name
        text = path.read_text()
        assert os.access(path, os.X_OK), f"chmod +x launch/{name}"
        for field in ("# Cluster:", "# Usage:", "# Example:"):
            assert field in text, f"launch/{name}: header lacks {field}"
        code = [l for l in text.splitlines() if l.strip() and not l.startswith("#")]
        assert len(code) <= 6 and any("common.sh" in l for l in code), f"launch/{name}: {code}"
    help_ = _run("gpu_1.sh", "--help", dry_run=False)
    assert help_.returncode == 0 and help_.stdout.startswith("Cluster: 1 GPU")


def test_real_hostfile_launch_from_another_directory(tmp_path):
    """Without --dry-run the script runs the launcher (a fake deepspeed here) with the printed
    arguments, from any directory, and writes the variables pdsh does not forward into
    ./.deepspeed_env, keeping the lines it does not own; the exit-code file it names is removed
    once the launcher has ended."""
    env = {**_fake_bin(tmp_path, "deepspeed", 'echo "$@"; echo "OMP=$OMP_NUM_THREADS NCCL=$NCCL_DEBUG"\n'),
           "OMP_NUM_THREADS": "3", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_DEBUG": "INFO",
           "TORCH_NCCL_BLOCKING_WAIT": "1", "WANDB_PROJECT": "p", "WANDB_API_KEY": "secret"}
    (tmp_path / ".deepspeed_env").write_text("MY_VAR=1\nOMP_NUM_THREADS=99\n")
    hostfile, recipe, config = _hostfile(tmp_path, 2), str(REPO / RECIPE), str(REPO / CONFIG)
    proc = _run("multinode_hostfile.sh", hostfile, recipe, config, env=env, cwd=tmp_path, dry_run=False)
    assert proc.returncode == 0, proc.stderr
    argv_line, env_line = proc.stdout.splitlines()
    assert shlex.split(argv_line)[:7] == ["--hostfile", hostfile, "--num_nodes", "2", "--num_gpus", "8",
                                          str(REPO / "launch" / "train.py")]
    assert env_line == "OMP=3 NCCL=INFO"
    # torch distributed and W&B run settings reach the remote ranks; the W&B key never is written.
    written = (tmp_path / ".deepspeed_env").read_text().splitlines()
    code_file = next(line for line in written if line.startswith("TRAIN_EXIT_CODE_FILE="))
    assert code_file.startswith(f"TRAIN_EXIT_CODE_FILE={tmp_path}/.train_exit_codes."), code_file
    assert not list(tmp_path.glob(".train_exit_codes.*"))
    assert [line for line in written if line != code_file] == [
        "MY_VAR=1", "CUDA_DEVICE_MAX_CONNECTIONS=1", "OMP_NUM_THREADS=3",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=3", "TORCH_NCCL_BLOCKING_WAIT=1", "TORCH_NCCL_DUMP_ON_TIMEOUT=1",
        "TORCH_NCCL_ENABLE_MONITORING=1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=600",
        "TORCH_NCCL_TRACE_BUFFER_SIZE=2000", "WANDB_PROJECT=p"]
    # The dry run prints the same command and leaves .deepspeed_env alone.
    (tmp_path / ".deepspeed_env").write_text("MY_VAR=2\n")
    dry = _run("multinode_hostfile.sh", hostfile, recipe, config, env=env, cwd=tmp_path)
    assert shlex.split(dry.stdout) == ["deepspeed", *shlex.split(argv_line)]
    assert (tmp_path / ".deepspeed_env").read_text() == "MY_VAR=2\n"


def test_a_hostfile_launch_hands_the_ranks_the_exit_code_file_through_deepspeed_env(tmp_path):
    """pdsh forwards only a few variables to the other nodes: the ranks there learn where to
    write their exit codes only from ./.deepspeed_env. The fake launcher reads its environment
    from that file alone, as a remote rank does, and reports bad input (2): the restart loop must
    read it and stop, not restart on the launcher's own code (1). The dry run prints the lines."""
    hostfile, recipe, config = _hostfile(tmp_path, 2), str(REPO / RECIPE), str(REPO / CONFIG)
    dry = _run("multinode_hostfile.sh", "--max-restarts", "2", hostfile, recipe, config, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    listed = next(line for line in dry.stderr.splitlines() if line.startswith("# .deepspeed_env: "))
    assert "TRAIN_EXIT_CODE_FILE=" + str(tmp_path / ".train_exit_codes.") in listed, listed
    assert not (tmp_path / ".deepspeed_env").exists()
    counter = tmp_path / "attempts"
    env = _fake_bin(tmp_path, "deepspeed", f'echo x >> {counter}\n'
                    'env -i sh -c \'. ./.deepspeed_env; echo "2 3" >> "$TRAIN_EXIT_CODE_FILE"\'\nexit 1\n')
    proc = _run("multinode_hostfile.sh", "--max-restarts", "2", hostfile, recipe, config, env=env,
                cwd=tmp_path, dry_run=False)
    assert proc.returncode == 2, proc.stderr
    assert counter.read_text().count("x") == 1 and "not restarted" in proc.stderr, proc.stderr


# A stand-in for a rank, started as the launchers start one ("python -u .../launch/train.py"):
# on SIGUSR1 it reports its exit code through the trainer's own functions (rank 0 first the
# checkpoint that verified, FAKE_SAVED, then its code) and exits 75.
FAKE_RANK = f"""import os, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
from training import files
def stop(*_):
    if os.environ.get("FAKE_SAVED"):
        files.record_saved(75, os.environ["FAKE_SAVED"])
    files.record_exit_code(75)
    sys.exit(75)
signal.signal(signal.SIGUSR1, stop)
open(os.environ["MARKS"] + "/started", "w").close()
time.sleep(60)
"""


def _fake_rank_launcher(tmp_path: Path, name: str, marks: Path, overlap: bool = False) -> dict:
    """A fake ``name`` (srun, deepspeed) that starts one fake rank and exits with its code,
    recording a SIGTERM it gets in ``marks/term``; a fake srun runs an ``--overlap`` step's
    command (the signaller) here, recording its arguments."""
    (tmp_path / "launch").mkdir(exist_ok=True)
    (tmp_path / "launch" / "train.py").write_text(FAKE_RANK)
    body = (f'case " $* " in *" --overlap "*) echo "$*" > {marks}/overlap\n'
            f'  while [ "$1" != sh ]; do shift; done; exec "$@" ;; esac\n' if overlap else "")
    body += (f"trap 'echo TERM > {marks}/term' TERM\n"
             f"{sys.executable} -u {tmp_path}/launch/train.py --local_rank=0 & rank=$!\n"
             f"while kill -0 $rank 2>/dev/null; do wait $rank; rc=$?; done\nexit $rc\n")
    return _fake_bin(tmp_path, name, body)


def _start_and_signal(argv: list[str], env: dict, marks: Path, signum) -> subprocess.CompletedProcess:
    import time
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.Popen(argv, cwd=marks.parent, env={**base, **env, "MARKS": str(marks)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 20
    while not (marks / "started").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert (marks / "started").exists(), proc.communicate(timeout=5)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=20)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.parametrize("saved", ["/runs/a/checkpoints/step00000007", None])
def test_slurm_script_passes_the_time_limit_warning_to_the_ranks_and_requeues(tmp_path, saved):
    """Not a dry run: a fake ``srun`` starts a fake rank, a fake ``scontrol`` records the requeue.
    SLURM's warning (USR1 to the batch script, ``--signal=B:USR1@600``) must reach the rank as
    SIGUSR1 through a step beside the job's (``srun --overlap``) while srun itself gets no
    signal; the script requeues the job, says which checkpoint the rank reported as verified (or
    that none was) and exits 0."""
    import signal
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**_slurm_env(tmp_path), **_fake_rank_launcher(tmp_path, "srun", marks, overlap=True)}
    _fake_bin(tmp_path, "scontrol", f'if [ "$1" = requeue ]; then echo "$2" > {marks}/requeued; exit 0; fi\n'
                                    f'for h in ' + " ".join(f"gpu{i:02d}" for i in range(1, 9))
              + '; do echo $h; done\n')
    env.update({"FAKE_SAVED": saved} if saved else {})
    done = _start_and_signal(["bash", str(REPO / "launch" / "slurm_8x8.sbatch"), str(REPO / RECIPE),
                              str(REPO / CONFIG)], env, marks, signal.SIGUSR1)
    assert done.returncode == 0, done.stderr
    assert not (marks / "term").exists(), "srun got a SIGTERM"
    assert (marks / "overlap").read_text().split()[:7] == ["--overlap", "--jobid", JOB_ID, "--nodes", "8",
                                                           "--ntasks-per-node", "1"]
    assert (marks / "requeued").read_text().strip() == JOB_ID
    assert "SLURM time limit near: SIGUSR1 to the ranks" in done.stderr, done.stderr
    said = (f"it resumes from {saved}" if saved else
            "no checkpoint verified after the signal: it resumes from the newest earlier one")
    assert f"requeued job {JOB_ID}; {said}" in done.stderr, done.stderr
    assert not list(tmp_path.glob(".train_exit_codes.*"))


def test_a_signal_to_a_deepspeed_launch_reaches_the_ranks_not_the_launcher(tmp_path):
    """DeepSpeed's launcher kills its ranks 30 s after a SIGTERM: the script keeps it out of the
    way. A SIGTERM to the script (a scheduler stopping the job) becomes SIGUSR1 to the rank; the
    fake launcher gets no signal and ends with its rank; the script exits 75 naming the
    checkpoint and does not restart (--max-restarts), since the stop was asked for."""
    import signal
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**_fake_rank_launcher(tmp_path, "deepspeed", marks), "FAKE_SAVED": "/ckpt/step00000003"}
    done = _start_and_signal(["bash", str(REPO / "launch" / "gpu_1.sh"), "--max-restarts", "2",
                              str(REPO / RECIPE), str(REPO / CONFIG)], env, marks, signal.SIGTERM)
    assert done.returncode == 75, done.stderr
    assert not (marks / "term").exists(), "the launcher got a SIGTERM"
    assert "SIGTERM: SIGUSR1 to the ranks" in done.stderr, done.stderr
    assert "stopped on request (exit code 75); it resumes from /ckpt/step00000003" in done.stderr
    assert "restart" not in done.stderr and done.stderr.count("+ deepspeed ") == 1, done.stderr


def test_slurm_script_exit_code_is_the_ranks_without_a_warning(tmp_path):
    """Without SLURM's warning the script exits with srun's code and requeues nothing."""
    env = _slurm_env(tmp_path)
    _fake_bin(tmp_path, "srun", "exit 3\n")
    proc = _run("slurm_8x8.sbatch", RECIPE, CONFIG, env=env, dry_run=False)
    assert proc.returncode == 3, proc.stderr
    assert "requeue" not in proc.stderr


# A fake launcher for the restart loop: attempt k (1-based) appends its line of ``plan`` to the
# trainer's exit-code file (as the ranks do) and exits with the launcher's code.
RESTART_PLANS = [
    # (attempts' "trainer codes|launcher rc", --max-restarts, exit code, attempts, restart lines)
    (["76 0|1", "|0"], 2, 0, 2, ["restart 1 of 2 after exit code 76 (a rank was lost or stopped making progress)"]),
    (["|247", "75 0;75 1|1", "|0"], 3, 0, 3,
     ["restart 1 of 3 after exit code 247 (the launcher exited 247 (a rank killed or failed))",
      "restart 2 of 3 after exit code 75 (preempted: the ranks saved their step)"]),
    (["2 0;2 1|1"], 3, 2, 1, []),                      # bad input: never restarted
    (["76 0;3 1|1"], 3, 3, 1, []),                     # out of memory on one rank wins
    (["74 0|1"], 3, 74, 1, []),
    (["76 0|1", "76 0|1"], 1, 76, 2, ["restart 1 of 1 after exit code 76 (a rank was lost or stopped making progress)"]),
]


@pytest.mark.parametrize("plan,restarts,code,attempts,lines", RESTART_PLANS)
def test_max_restarts_reruns_on_lost_ranks_and_preemption_never_on_bad_input(
        tmp_path, plan, restarts, code, attempts, lines):
    counter = tmp_path / "attempts"
    cases = " ".join(f"'{p}'" for p in plan)
    body = (f'n=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 )); echo $n > {counter}\n'
            f'set -- {cases}; shift $((n - 1)); p=$1\n'
            'codes=${p%%|*}; rc=${p##*|}\n'
            'IFS=";"; for c in $codes; do [ -n "$c" ] && echo "$c" >> "$TRAIN_EXIT_CODE_FILE"; done\n'
            'exit $rc\n')
    env = _fake_bin(tmp_path, "deepspeed", body)
    proc = _run("gpu_1.sh", "--max-restarts", str(restarts), str(REPO / RECIPE), str(REPO / CONFIG),
                *EXTRA, env=env, cwd=tmp_path, dry_run=False)
    assert proc.returncode == code, proc.stderr
    assert int(counter.read_text()) == attempts, proc.stderr
    restarts_logged = [line.split(": ", 1)[1].split(": the same command")[0]
                       for line in proc.stderr.splitlines() if ": restart " in line]
    assert restarts_logged == lines, proc.stderr
    assert proc.stderr.count("+ deepspeed ") == attempts
    assert not list(tmp_path.glob(".train_exit_codes.*"))      # the loop's file removed


@pytest.mark.parametrize("bad", [["--max-restarts"], ["--max-restarts", "x"], ["--max-restarts=-1"]])
def test_max_restarts_needs_a_count(bad):
    proc = _run("gpu_1.sh", *bad, RECIPE, CONFIG)
    assert proc.returncode == 2 and "--max-restarts takes a count >= 0" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
