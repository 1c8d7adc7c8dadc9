"""Launch ``launch/train.py`` as a user would (torchrun or plain python) and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from training.run.spawn import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS = 10
# A small MoE model so that each step takes milliseconds; router jitter on, so that the resume
# test also proves the RNG streams continue.
SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.ffn_hidden_size=64",
         "model.max_seq_len=64", "data.seq_len=64", "data.max_bytes=1500000",
         "tokenizer.train_bytes=1500000", "model.moe.router_jitter=0.01", "eval.every=5",
         "eval.batches=2", "train.log_every=5"]
# Absolute tolerance for weights compared with the single-process control after a few AdamW
# steps (with rtol 1e-4). Nearly every weight agrees to ~1e-7, but AdamW's m / (sqrt(v) + eps)
# turns a layout's rounding difference in a near-zero gradient (a rare token's embedding row,
# where the contributions nearly cancel) into a visible fraction of one step's lr: measured up to
# 7.1e-6 on one element of 262,144 (10 steps, PP2 x TP2). A wrong shard or a wrong update is off
# by O(init_std) = 2e-2 or by about lr = 6e-4 per step, 20x this bound or more.
WEIGHT_ATOL = 3e-5


def env():
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true",
               TOKENIZERS_PARALLELISM="false")
    env.pop("RANK", None)
    return env


def launch(run_dir: Path, config: str, nproc: int = 2, extra=(), timeout: int = 300,
           wait: bool = True, steps: int = STEPS, script: str = "launch/train.py",
           extra_env: dict | None = None, check: bool = True):
    """Start ``launch/train.py`` (or a test ``script`` that wraps it) like a user would
    (torchrun for nproc > 1); with ``wait``, assert exit code 0 unless ``check`` is False."""
    prefix = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port())] if nproc > 1 else [sys.executable])
    cmd = prefix + [script, "--config", config, "--run-dir", str(run_dir),
                    "--steps", str(steps), "--set", *SMALL, *extra]
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env(), **(extra_env or {})}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    if not wait:
        return proc
    rc = proc.wait(timeout=timeout)
    assert rc == 0 or not check, (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]
    return proc


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def ds_variant(tmp: Path, name: str, **changes) -> str:
    cfg = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    cfg.update(changes)
    path = tmp / f"{name}-{'-'.join(f'{k}{v}' for k, v in changes.items())}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def kill_after_step(proc, run_dir: Path, step: int, timeout: float = 300) -> None:
    """SIGKILL every process of a run once its metrics.jsonl shows ``step`` (a crash mid-run)."""
    import signal
    import time
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and f'"step": {step},' in metrics.read_text():
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    # torchrun puts its workers in their own sessions: kill every process of this run.
    os.killpg(proc.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-KILL", "-f", str(run_dir)], check=False)
    proc.wait()
    time.sleep(1)


# ------------------------------------------------------------------------------------------------
# Warm launches: every rank a process forked from one that has already imported the libraries.

# Importing these is about two thirds of a tiny 1-rank run's CPU time (py-spy on 2 cores: torch;
# torch._dynamo, for ``torch.compiler.disable`` in model/moe/layer.py; inductor, for the
# ``torch.compile`` in DeepSpeed's optimizer check; transformers). The repository's own modules
# are not preloaded: each rank imports and runs them as ``python script`` would.
PRELOAD = ("numpy", "yaml", "torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx",
           "tokenizers", "transformers", "deepspeed", "deepspeed.runtime.engine", "deepspeed.pipe",
           "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
           "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.utils.zero_to_fp32")
PRELOAD_ATTRS = ("PreTrainedTokenizerFast", "AutoTokenizer", "get_inverse_sqrt_schedule",
                 "get_wsd_schedule", "LlamaConfig", "MixtralConfig")     # transformers' lazy names


class WarmLauncher:
    """Runs ``launch/train.py`` (or a test ``script`` that wraps it) as ``launch(wait=True)`` does,
    with the same command line, but forks each rank from one server process that has imported
    torch, DeepSpeed and transformers once (``PRELOAD``) instead of starting a fresh interpreter
    per rank under torchrun: a 2-rank EP2 run of the tiny model costs about 17 CPU-seconds
    instead of 37 (measured on the 2-core CI machine).

    A rank gets the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, ...; none at ``nproc`` 1, as ``python script``), fresh Python and numpy
    random states, its output appended to ``<run_dir>.log``, and runs ``script`` as ``__main__``;
    the ranks of a run share a process group of their own. As under torchrun, the others are
    stopped 30 s after a rank fails, unless they exit first. For runs whose subject is what the
    trainer computes or prints; the launcher itself, signals and kills are tested through
    ``launch``. Use as a context manager (one server per test module); ``cpu_s`` is the last
    run's CPU seconds, all ranks together.
    """

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.runs"], cwd=REPO, env=env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.cpu_s = None

    def __enter__(self) -> "WarmLauncher":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def launch(self, run_dir: Path, config: str, nproc: int = 2, extra=(), timeout: int = 300,
               steps: int = STEPS, script: str = "launch/train.py", extra_env: dict | None = None,
               check: bool = True) -> int:
        """``launch``'s arguments and command line; returns the exit code (the first failing
        rank's, -9 past ``timeout``), asserting 0 unless ``check`` is False."""
        log = run_dir.parent / f"{run_dir.name}.log"
        rc = self.run([script, "--config", config, "--run-dir", str(run_dir), "--steps", str(steps),
                       "--set", *SMALL, *extra], log, nproc, timeout, extra_env)
        assert rc == 0 or not check, log.read_text()[-3000:]
        return rc

    def launch_many(self, runs: list[tuple], nproc: int = 2, timeout: int = 600,
                    steps: int = STEPS, check: bool = True) -> int:
        """Several trainings, one after another, on the same ``nproc`` ranks: each rank is one
        process that joins one process group and calls ``launch.train.main`` once per run (the
        run object joins the group it finds and leaves it, ``training/run/trainer.py``). Each
        of ``runs`` is ``(run_dir, config, extra)`` or ``(run_dir, config, extra, steps)``, the
        arguments of ``launch``; its output goes to ``<run_dir>.log``. A run that fails stops the
        batch: returns the exit code (the first failing rank's), asserting 0 unless ``check``."""
        batch = []
        for run in runs:
            run_dir, config, extra, n = (*run, steps) if len(run) == 3 else run
            batch.append({"argv": ["--config", config, "--run-dir", str(run_dir), "--steps", str(n),
                                   "--set", *SMALL, *extra],
                          "log": str(run_dir.parent / f"{run_dir.name}.log")})
        request = {"runs": batch, "nproc": nproc, "env": env(), "log": batch[0]["log"],
                   "stderr": batch[0]["log"], "timeout": timeout}
        rc = self._ask(request)
        if check and rc != 0:
            failed = [Path(b["log"]) for b in batch if Path(b["log"]).is_file()][-1]
            raise AssertionError(f"exit code {rc}; {failed}:\n" + failed.read_text()[-3000:])
        return rc

    def script(self, script: str, args: list[str], log: Path, nproc: int = 2, timeout: int = 300,
               extra_env: dict | None = None) -> None:
        """``script`` (a test wrapper of ``launch/train.py``) with ``args`` on ``nproc`` ranks, as
        ``python -m torch.distributed.run --nproc_per_node nproc script args`` runs it: asserts
        exit code 0, with the end of ``log`` (the ranks' output) in the message otherwise."""
        rc = self.run([script, *args], log, nproc, timeout, extra_env)
        assert rc == 0, f"exit code {rc}:\n" + (log.read_text()[-4000:] if log.is_file() else "")

    def run(self, argv: list[str], log: Path, nproc: int = 1, timeout: int = 300,
            extra_env: dict | None = None, stderr: Path | None = None) -> int:
        """``argv`` (a script relative to the repository, then its arguments) on ``nproc``
        ranks, their output appended to ``log`` (their stderr to ``stderr`` if given); returns
        the exit code."""
        request = {"argv": list(argv), "nproc": nproc, "env": {**env(), **(extra_env or {})},
                   "log": str(log), "stderr": str(stderr or log), "timeout": timeout}
        return self._ask(request)

    def _ask(self, request: dict) -> int:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, f"the warm launcher's server exited with code {self.proc.wait()}"
        reply = json.loads(reply)
        self.cpu_s = reply["cpu_s"]
        return reply["rc"]


_SHARED: list[WarmLauncher] = []


def shared_launcher() -> WarmLauncher:
    """This pytest process's one warm launcher (the ``warm_launcher`` fixture), started on first
    use and stopped when the process exits."""
    if not _SHARED:
        import atexit
        _SHARED.append(WarmLauncher())
        atexit.register(_SHARED[0].__exit__)
    return _SHARED[0]


def python(script: str, *args: str, timeout: int = 300, extra_env: dict | None = None,
           check: bool = False) -> subprocess.CompletedProcess:
    """``python script args`` (a repository script, from the repository root; ``python("-m",
    "benchmarks.systems.comm_volume", ...)`` for a module) as a user runs it,
    on a process forked from the warm launcher's server (libraries imported once): its exit code,
    stdout and stderr, as ``subprocess.run(..., capture_output=True, text=True)`` returns them.
    For tools whose subject is what they compute and print, not which modules they import."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        rc = shared_launcher().run([script, *args], out, 1, timeout, extra_env, stderr=err)
        done = subprocess.CompletedProcess([sys.executable, script, *args], rc,
                                           out.read_text() if out.is_file() else "",
                                           err.read_text() if err.is_file() else "")
    assert rc == 0 or not check, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _torchrun_env(rank: int, nproc: int, port: int) -> dict:
    """What torchrun's agent sets for worker ``rank`` of ``nproc`` on one node; the ranks
    rendezvous at rank 0's store, not at an agent's."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                ROLE_NAME="default", LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(nproc),
                GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="False")


def _run_rank(request: dict, rank: int, port: int, leader: int) -> None:
    """In a forked child: become rank ``rank`` of the request and run its script as
    ``__main__``. The child then ends as ``python script`` would: ``sys.exit`` and uncaught
    errors (traceback, code 1) as Python handles them, and with the interpreter's finalization
    (atexit handlers, flushed streams). It never returns to the server's loop."""
    import random
    import runpy
    import traceback
    try:
        os.setpgid(0, leader)                      # the run's group (leader 0: a new one)
        os.environ.clear()
        os.environ.update(request["env"])
        if request["nproc"] > 1:
            os.environ.update(_torchrun_env(rank, request["nproc"], port))
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)    # nor the server's pipes
        for fd, path in ((1, request["log"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
        random.seed()                              # a fresh process's entropy, not the server's
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if "runs" in request:
            os._exit(_run_many(request))
        argv = request["argv"]
        if argv[0] == "-m":                        # ``python -m module``: the root on sys.path
            module, script = argv[1], None
            sys.argv = [module, *argv[2:]]
            sys.path[0] = str(REPO)
        else:
            script = str(REPO / argv[0])
            sys.argv = [script, *argv[1:]]
            sys.path[0] = os.path.dirname(script)  # as ``python script`` sets it
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    if script is None:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def _run_many(request: dict) -> int:
    """In a forked rank of ``WarmLauncher.launch_many``: the process group, then each run's
    ``launch.train.main`` with its output in its log and torch's global RNG as a fresh process
    has it; the first non-zero exit code ends the batch. Returns the code to exit with."""
    import torch
    import torch.distributed as dist

    from launch import train
    sys.path[0] = str(REPO / "launch")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("gloo")
    fresh_seed = torch.initial_seed()
    for run in request["runs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(run["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        torch.manual_seed(fresh_seed)
        sys.argv = [str(REPO / "launch" / "train.py"), *run["argv"]]
        try:
            code = train.main(run["argv"])
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        if code:
            return code
    return 0


def _serve() -> None:
    """The warm launcher's server: preload, then per request line fork the run's ranks, wait for
    them and answer one line, ``{"rc": ..., "cpu_s": ...}``."""
    import contextlib
    import importlib
    import signal
    import time
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                                  # what the libraries print goes to stderr
    for name in PRELOAD:                           # only saves time: a missing one is skipped
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    for name in PRELOAD_ATTRS:
        with contextlib.suppress(ImportError, AttributeError):
            getattr(sys.modules["transformers"], name)
    for line in sys.stdin:
        request, port = json.loads(line), free_port()
        sys.stdout.flush()                         # nothing buffered for the children to repeat
        sys.stderr.flush()
        pids = []
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                replies.close()                    # only the server answers
                _run_rank(request, rank, port, pids[0] if pids else 0)
            if not pids:                           # rank 0 leads the group (before rank 1 joins)
                with contextlib.suppress(OSError):  # (it may have set it, or exited, already)
                    os.setpgid(pid, pid)
            pids.append(pid)
        running, failed, cpu = set(pids), [], 0.0
        deadline = time.time() + request["timeout"]
        while running:
            for pid in list(running):
                done, status, usage = os.wait4(pid, os.WNOHANG)
                if done:
                    running.discard(pid)
                    cpu += usage.ru_utime + usage.ru_stime
                    if os.waitstatus_to_exitcode(status) != 0:
                        failed.append(os.waitstatus_to_exitcode(status))
                        # The others may be failing too (a failed save stops every rank): 30 s,
                        # torchrun's grace, to exit on their own, then they are stopped.
                        deadline = min(deadline, time.time() + 30)
            if running and time.time() > deadline:
                os.killpg(pids[0], signal.SIGKILL)
                for pid in running:
                    usage = os.wait4(pid, 0)[2]
                    cpu += usage.ru_utime + usage.ru_stime
                failed.append(-signal.SIGKILL)
                break
            time.sleep(0.05)
        replies.write(json.dumps({"rc": failed[0] if failed else 0, "cpu_s": round(cpu, 1)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
