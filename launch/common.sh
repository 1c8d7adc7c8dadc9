# shellcheck shell=bash
# Shared logic of the launch scripts (launch/*.sh, launch/slurm_8x8.sbatch). Sourced, never run.
#
# A launch script sets the cluster shape, sources this file and calls one launch_* function:
#     NUM_NODES=2; NPROC_PER_NODE=8; source launch/common.sh; launch_deepspeed_hostfile "$@"
# Its arguments: [--dry-run] [--max-restarts N] [HOSTFILE] RECIPE CONFIG [train.py args ...].
# Everything after CONFIG goes to launch/train.py unchanged (--steps N, --run-dir D, --set k=v ...,
# --init-from D). --dry-run (anywhere) prints the exact command on stdout, shell-quoted on one
# line, and the environment on stderr, and exits 0 without running anything. --max-restarts N
# (anywhere; default 0) reruns the command, which resumes from the newest verified checkpoint,
# up to N times after a lost or stopped rank (exit code 76), a preemption the scheduler does not
# requeue (75) or a launcher that died with a killed rank; never after bad input (2), out of
# memory (3) or a checkpoint that could not be written (74) (_run_restarting). A preemption
# (SIGTERM, SIGUSR1 or SIGINT to the script; SLURM's warning) reaches the ranks as SIGUSR1, never
# as a SIGTERM to a launcher that kills its ranks 30 s later, and the ranks get PREEMPT_GRACE_S
# to finish their step and save it (docs/reliability.md, "Preemption"). Paths are relative to the
# directory you run from, as for every other command in this repo; multi-node runs need the repo
# and the paths at the same place on every node (a shared filesystem).

set -euo pipefail

_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# launch/train.py as the user would type it from the repo root; absolute from anywhere else.
if [[ $PWD == "$_REPO" ]]; then TRAIN_PY=launch/train.py; else TRAIN_PY=$_REPO/launch/train.py; fi

die() { echo "$(basename "$0"): error: $*" >&2; exit 2; }
_usage() { sed -n 's/^# Usage: /usage: /p' "$0" >&2; }

# _setenv NAME DEFAULT: keep NAME from the caller's environment, else DEFAULT. An empty value
# leaves NAME unset, so NCCL or CUDA picks its own default.
_ENV_NAMES=()
_setenv() {
    local value=${!1-$2}
    if [[ -n $value ]]; then export "$1=$value"; else unset "$1"; fi
    _ENV_NAMES+=("$1")
}

[[ ${NPROC_PER_NODE-} =~ ^[1-9][0-9]*$ ]] ||
    die "ranks per node (NPROC for cpu_local.sh) must be a positive integer, got '${NPROC_PER_NODE-}'"

# ---- Environment. Every value below can be overridden by exporting it before running a script.
# InfiniBand adapters NCCL may use (e.g. mlx5_0,mlx5_1): set when some are down or on another fabric.
_setenv NCCL_IB_HCA ""
# NIC for NCCL's bootstrap and sockets (e.g. eth0, ^docker,lo): set when NCCL picks one other nodes can't reach.
_setenv NCCL_SOCKET_IFNAME ""
# 1 forces TCP sockets instead of InfiniBand/RoCE: on clusters without IB, or to rule IB out in a hang.
_setenv NCCL_IB_DISABLE ""
# PyTorch's NCCL watchdog: a collective that fails or times out aborts its communicator and ends the rank (3: abort, tear down).
_setenv TORCH_NCCL_ASYNC_ERROR_HANDLING 3
# The Flight Recorder: each rank keeps its last N collectives and their states for a dump (read: docs/reliability.md).
_setenv TORCH_NCCL_TRACE_BUFFER_SIZE 2000
# Dump it on a collective timeout, into <run dir>/hang/ (the trainer sets TORCH_NCCL_DEBUG_INFO_TEMP_FILE there).
_setenv TORCH_NCCL_DUMP_ON_TIMEOUT 1
# The heartbeat monitor: a rank whose NCCL watchdog thread is itself stuck this long is killed, after its dump.
_setenv TORCH_NCCL_ENABLE_MONITORING 1
_setenv TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC 600
# NVLink SHARP on NVSwitch nodes (H100/H200): 0 when NVLS fails to start in a container or its buffers cost memory.
_setenv NCCL_NVLS_ENABLE ""
# WARN prints only problems; INFO shows the rings and transports chosen: use it for hangs and slow collectives.
_setenv NCCL_DEBUG WARN
# Hardware queues per GPU (CUDA default 8): 1 only for Megatron-style TP overlap; 1 serializes ZeRO-3 prefetch.
_setenv CUDA_DEVICE_MAX_CONNECTIONS ""
# CPU threads per rank, cores / ranks per node so ranks don't oversubscribe: lower it if data-loader workers need cores.
_CORES=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
_setenv OMP_NUM_THREADS "$(( _CORES / NPROC_PER_NODE > 0 ? _CORES / NPROC_PER_NODE : 1 ))"
# Seconds from a preemption signal to the kill that follows it: the ranks' time to finish their
# step and save it. SLURM does not tell the job its --signal lead time, so this carries it: by
# default the lead time the batch script's own "#SBATCH --signal=...@SECONDS" line asks for, else
# 600. torchrun waits this long for its ranks after a signal (--shutdown-timeout); set it to the
# lead time when you submit with another --signal.
_SBATCH_LEAD=$(sed -n 's/^#SBATCH --signal=[^@]*@\([0-9][0-9]*\).*/\1/p' "$0" 2>/dev/null | head -n 1)
_setenv PREEMPT_GRACE_S "${_SBATCH_LEAD:-600}"
[[ $PREEMPT_GRACE_S =~ ^[1-9][0-9]*$ ]] ||
    die "PREEMPT_GRACE_S must be a whole number of seconds > 0, got '$PREEMPT_GRACE_S'"

# _parse NPOS "NAME ..." ARGS...: sets DRY_RUN, POS (the NPOS positional arguments, checked to
# be files) and TRAIN_ARGS (the rest).
_parse() {
    local npos=$1 names a
    read -ra names <<<"$2"
    shift 2
    DRY_RUN=0 MAX_RESTARTS=0 POS=() TRAIN_ARGS=()
    local want_n=0
    for a in "$@"; do
        if (( want_n )); then
            [[ $a =~ ^[0-9]+$ ]] || { _usage; die "--max-restarts takes a count >= 0, got '$a'"; }
            MAX_RESTARTS=$a want_n=0
        elif [[ $a == --max-restarts ]]; then want_n=1
        elif [[ $a == --max-restarts=* ]]; then
            [[ ${a#*=} =~ ^[0-9]+$ ]] || { _usage; die "--max-restarts takes a count >= 0, got '${a#*=}'"; }
            MAX_RESTARTS=${a#*=}
        elif [[ $a == --dry-run ]]; then DRY_RUN=1
        elif (( ${#POS[@]} < npos )); then
            if [[ $a == -h || $a == --help ]]; then    # the script's header comment
                sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0
            fi
            [[ $a == -* ]] && { _usage; die "expected ${names[${#POS[@]}]}, got option $a"; }
            POS+=("$a")
        else
            [[ $a == --config* || $a == --recipe* ]] &&
                { _usage; die "give RECIPE and CONFIG as positional arguments, not $a"; }
            TRAIN_ARGS+=("$a")
        fi
    done
    (( want_n )) && { _usage; die "--max-restarts takes a count >= 0"; }
    (( ${#POS[@]} == npos )) || { _usage; die "missing ${names[*]:${#POS[@]}}"; }
    for a in "${POS[@]}"; do [[ -f $a ]] || die "no such file: $a"; done
}

# The trainer's part of every command: train.py, CONFIG, RECIPE, then the pass-through arguments.
# (${X[@]+"${X[@]}"}: an empty array under `set -u` on bash < 4.4, still common on clusters.)
_train() { TRAIN=("$TRAIN_PY" --config "$CONFIG" --recipe "$RECIPE" ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}); }

# _quote ARGS...: one line that a POSIX shell (and Python's shlex.split) reads back as ARGS.
_quote() {
    local out=() a
    for a in "$@"; do
        if [[ $a =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
    done
    echo "${out[*]}"
}

# _run ARGS...: print (--dry-run) or log and exec the command (with --max-restarts, rerun it).
_run() {
    local n env=()
    for n in "${_ENV_NAMES[@]}"; do [[ -n ${!n+set} ]] && env+=("$n=${!n}"); done
    if (( DRY_RUN )); then echo "# env: ${env[*]-}" >&2; _quote "$@"; exit 0; fi
    (( MAX_RESTARTS > 0 )) && _run_restarting _run_once "$@"
    echo "+ $(_quote "$@")" >&2
    exec "$@"
}

_run_once() { echo "+ $(_quote "$@")" >&2; "$@"; }

# _trainer_code RC: the trainer's exit code for an attempt whose launcher exited RC. The launchers
# report their own (torchrun 1, DeepSpeed's the first failed rank's, 247 for a SIGKILL), so every
# rank that exits non-zero appends "CODE RANK" to $TRAIN_EXIT_CODE_FILE (training/files.py):
# bad input, out of memory or an unwritable checkpoint on any rank wins, then a preemption, then a
# lost or stopped rank; with no line (every rank killed), the launcher's code.
_trainer_code() {
    local codes c
    codes=$(awk '{print $1}' "$TRAIN_EXIT_CODE_FILE" 2>/dev/null | sort -u | tr '\n' ' ')
    for c in 2 3 74 75 76; do [[ " $codes" == *" $c "* ]] && { echo "$c"; return; }; done
    echo "$1"
}

# _run_restarting RUNNER ARGS...: RUNNER ARGS (_run_once, or _attempt), rerun up to
# MAX_RESTARTS times while the trainer's exit code says a rerun can finish the job; each restart
# is one line with its reason. The same command resumes from the newest verified checkpoint.
_run_restarting() {
    local runner=$1 attempt=0 rc code reason
    shift
    export TRAIN_EXIT_CODE_FILE=${TRAIN_EXIT_CODE_FILE:-$PWD/.train_exit_codes.$$}
    while :; do
        rm -f "$TRAIN_EXIT_CODE_FILE"
        rc=0; "$runner" "$@" || rc=$?
        (( rc == 0 )) && { rm -f "$TRAIN_EXIT_CODE_FILE"; exit 0; }
        code=$(_trainer_code "$rc")
        rm -f "$TRAIN_EXIT_CODE_FILE"
        case $code in
            2|3|74) echo "$(basename "$0"): exit code $code (bad input, out of memory or an unwritable checkpoint: see the error above); not restarted" >&2
                    exit "$code" ;;
            75) reason="preempted: the ranks saved their step" ;;
            76) reason="a rank was lost or stopped making progress" ;;
            *)  reason="the launcher exited $rc (a rank killed or failed)" ;;
        esac
        if (( attempt >= MAX_RESTARTS )); then
            echo "$(basename "$0"): exit code $code ($reason); no restarts left (--max-restarts $MAX_RESTARTS)" >&2
            exit "$code"
        fi
        attempt=$((attempt + 1))
        echo "$(basename "$0"): restart $attempt of $MAX_RESTARTS after exit code $code ($reason): the same command resumes from the newest checkpoint" >&2
    done
}

# ---- Preemption: the signal reaches the ranks, and the ranks get the grace period.
#
# The ranks (training/resilience/preemption.py) take SIGUSR1 (or SIGTERM) as "finish this step,
# save it, exit 75". The launchers must not cut that save short: DeepSpeed's per-node launcher
# kills its ranks 30 s after it gets a SIGTERM (hard-coded) and its pdsh runner pkills every node,
# and torchrun waits --shutdown-timeout. So the scripts never pass a preemption to a DeepSpeed
# launcher: they send SIGUSR1 to the ranks themselves, on every node, and wait for the launcher
# to end on its own; torchrun gets --shutdown-timeout PREEMPT_GRACE_S and forwards SIGUSR1 too.

# This launch's ranks on a node: a command line as torchrun and DeepSpeed's launcher start a rank
# ("python -u .../launch/train.py ...", where the launchers' own name train.py later), and in
# the environment it started with, this launch's TRAIN_EXIT_CODE_FILE (the launchers have it
# too, the ranks of another run on the node do not).
_RANK_PATTERN='^[^ ]*python[^ ]* -u [^ ]*launch/train\.py( |$)'
# torchrun's part: it forwards SIGUSR1 as it does SIGTERM, and waits the grace before SIGKILL.
_TORCHRUN_GRACE=(--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "$PREEMPT_GRACE_S")

# _signal_command: the POSIX shell command that sends SIGUSR1 to this launch's ranks on one node.
_signal_command() {
    local pattern marker
    pattern=$(_quote "$_RANK_PATTERN") marker=$(_quote "TRAIN_EXIT_CODE_FILE=$TRAIN_EXIT_CODE_FILE")
    echo "for p in \$(pgrep -U $(id -u) -f $pattern); do tr '\\0' '\\n' </proc/\$p/environ 2>/dev/null | grep -qxF $marker && kill -USR1 \$p; done; true"
}

# _signal_ranks WHERE: SIGUSR1 to this launch's ranks: "local" (this host), "hosts H1,H2" (pdsh
# over ssh, as DeepSpeed's runner) or "slurm" (a step beside the job's, on every node; scancel's
# signal to the job's steps if that step cannot start). Bounded: it never holds the script.
_signal_ranks() {
    local cmd
    cmd=$(_signal_command)
    case $1 in
        local) sh -c "$cmd" ;;
        hosts) PDSH_RCMD_TYPE=${PDSH_RCMD_TYPE:-ssh} timeout 120 pdsh -S -w "$2" "$cmd" || true ;;
        slurm) timeout 120 srun --overlap --jobid "$SLURM_JOB_ID" --nodes "$NUM_NODES" --ntasks-per-node 1 \
                   sh -c "$cmd" || scancel --signal=USR1 "$SLURM_JOB_ID" || true ;;
    esac
}

# _saved_line CODE_FILE: what the ranks' exit codes say was saved on preemption (rank 0 appends
# "75 0 saved=<checkpoint>" once that checkpoint verified).
_saved_line() {
    local saved
    saved=$(sed -n 's/^75 [0-9]* saved=//p' "$1" 2>/dev/null | tail -n 1)
    if [[ -n $saved ]]; then echo "it resumes from $saved"
    else echo "no checkpoint verified after the signal: it resumes from the newest earlier one, and the steps since are trained again"; fi
}

# _run_signalled ARGS...: as _run, for a launcher that must not get the preemption signal; _WHERE
# says where the ranks are: (local), (hosts H1,H2) or (slurm). The script stays up while ARGS
# runs, and a preemption to it becomes SIGUSR1 to the ranks (_signal_ranks): with slurm, SLURM's
# warning (USR1, `#SBATCH --signal=B:USR1@SECONDS`), after which the job requeues itself
# (`--requeue`); else a SIGTERM, SIGINT, SIGHUP or SIGUSR1, after which the script exits with the
# ranks' 75 and is not restarted (--max-restarts): whoever signalled wants it stopped. The
# launcher ends when its ranks do; the last line names the checkpoint that verified.
_run_signalled() {
    (( DRY_RUN )) && _run "$@"
    export TRAIN_EXIT_CODE_FILE=${TRAIN_EXIT_CODE_FILE:-$PWD/.train_exit_codes.${SLURM_JOB_ID:-$$}}
    if [[ ${_WHERE[0]} == slurm ]]; then _SIGNALS=(USR1); else _SIGNALS=(TERM INT HUP USR1); fi
    (( MAX_RESTARTS > 0 )) && _run_restarting _attempt "$@"
    local rc=0
    _attempt "$@" || rc=$?
    rm -f "$TRAIN_EXIT_CODE_FILE"
    exit "$rc"
}

# _attempt ARGS...: one run of ARGS in the background, waited for through the traps; returns its
# exit code, or ends the script once a preemption came (_preempted).
_attempt() {
    echo "+ $(_quote "$@")" >&2
    rm -f "$TRAIN_EXIT_CODE_FILE"
    "$@" &
    _CHILD=$! _PREEMPTED=0
    local sig rc
    for sig in "${_SIGNALS[@]}"; do
        # shellcheck disable=SC2064
        trap "_preempt $sig" "$sig"
    done
    while :; do
        rc=0; wait "$_CHILD" || rc=$?
        kill -0 "$_CHILD" 2>/dev/null || break      # still running: a trap cut the wait short
    done
    # A child that ended while a trap ran leaves rc at the trap's 128+N: bash keeps its status.
    if (( rc > 128 )); then local again=0; wait "$_CHILD" || again=$?; (( again == 127 )) || rc=$again; fi
    trap - "${_SIGNALS[@]}"
    (( _PREEMPTED )) && _preempted "$rc"
    return "$rc"
}

_preempt() {
    (( _PREEMPTED )) && return
    _PREEMPTED=1
    if [[ ${_WHERE[0]} == slurm ]]; then
        echo "$(basename "$0"): SLURM time limit near: SIGUSR1 to the ranks, which save their step and exit (grace $PREEMPT_GRACE_S s)" >&2
    else
        echo "$(basename "$0"): SIG$1: SIGUSR1 to the ranks, which finish their step, save it and exit (the launcher is left to end with them)" >&2
    fi
    _signal_ranks "${_WHERE[@]}"
}

# _preempted RC: the end of a preempted attempt: requeue (SLURM) or stop, naming what was saved.
# A launcher that exited 0 with no rank's code recorded ran the run to its end: its last step's
# signal agreement came before the signal reached the ranks, and their final save verified;
# there is nothing to resume, so the job is not requeued.
_preempted() {
    local saved
    saved=$(_saved_line "$TRAIN_EXIT_CODE_FILE")
    if (( $1 == 0 )) && [[ ! -s $TRAIN_EXIT_CODE_FILE ]]; then
        rm -f "$TRAIN_EXIT_CODE_FILE"
        echo "$(basename "$0"): the run finished before the signal reached its ranks (exit code 0): nothing to resume, not requeued" >&2
        exit 0
    fi
    rm -f "$TRAIN_EXIT_CODE_FILE"
    if [[ ${_WHERE[0]} == slurm ]]; then
        scontrol requeue "$SLURM_JOB_ID" ||
            die "scontrol requeue $SLURM_JOB_ID failed: submit the same sbatch line again to resume ($saved)"
        echo "$(basename "$0"): requeued job $SLURM_JOB_ID; $saved" >&2
        exit 0
    fi
    echo "$(basename "$0"): stopped on request (exit code $1); $saved; run the same command to resume" >&2
    exit "$1"
}

# ---- One function per launcher.

# Local CPU ranks over gloo. torchrun --standalone rather than `deepspeed --num_gpus N`: it is the
# launcher the multi-rank tests use, and it picks a free port, so two local runs do not collide
# on DeepSpeed's fixed 29500.
launch_torchrun_cpu() {
    _parse 2 "RECIPE CONFIG" "$@"; RECIPE=${POS[0]} CONFIG=${POS[1]}; _train
    export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu   # gloo on CPU even on a machine with GPUs
    _ENV_NAMES+=(CUDA_VISIBLE_DEVICES DS_ACCELERATOR)
    # glibc's malloc keeps large freed blocks instead of unmapping them every step (less system
    # time: docs/performance/cpu-allocator.md).
    _setenv MALLOC_MMAP_THRESHOLD_ 4294967296
    _setenv MALLOC_TRIM_THRESHOLD_ 68719476736
    _run torchrun --standalone --nnodes "$NUM_NODES" --nproc_per_node "$NPROC_PER_NODE" "${_TORCHRUN_GRACE[@]}" "${TRAIN[@]}"
}

# One node: DeepSpeed starts NPROC_PER_NODE ranks on GPUs 0..N-1.
launch_deepspeed() {
    _parse 2 "RECIPE CONFIG" "$@"; RECIPE=${POS[0]} CONFIG=${POS[1]}; _train
    _WHERE=(local)
    _run_signalled deepspeed --num_gpus "$NPROC_PER_NODE" ${MASTER_PORT:+--master_port "$MASTER_PORT"} "${TRAIN[@]}"
}

# Several nodes from a DeepSpeed hostfile ("HOST slots=8" per line): DeepSpeed ssh-es (pdsh) into
# the first NUM_NODES hosts. It forwards only NCCL_*, PYTHON*, UCX_* and the like to them; the
# other variables set above (the NCCL watchdog and Flight Recorder ones too), and the torch
# distributed settings and W&B run settings exported by the caller (TORCH_NCCL_*, TORCH_FR_*,
# TORCH_DISTRIBUTED_*, TORCH_CPP_LOG_LEVEL, WANDB_PROJECT/ENTITY/
# MODE/DIR/BASE_URL), travel in ./.deepspeed_env, which it reads at start. Never the W&B key:
# put WANDB_API_KEY=... in ~/.deepspeed_env (DeepSpeed reads it too) or run `wandb login` on
# the first host, where global rank 0, the only rank that talks to W&B, runs.
launch_deepspeed_hostfile() {
    _parse 3 "HOSTFILE RECIPE CONFIG" "$@"; HOSTFILE=${POS[0]} RECIPE=${POS[1]} CONFIG=${POS[2]}; _train
    local hosts
    hosts=$(awk '!/^[[:space:]]*(#|$)/ {n++} END {print n + 0}' "$HOSTFILE")
    (( hosts >= NUM_NODES )) ||
        die "$HOSTFILE lists $hosts hosts, this script needs $NUM_NODES ('HOST slots=$NPROC_PER_NODE' per line)"
    # The restart loop and the preemption message read the ranks' exit codes from this file
    # (_run_restarting, _saved_line): the remote ranks get its name only through .deepspeed_env,
    # so it is set before that file is written.
    export TRAIN_EXIT_CODE_FILE=${TRAIN_EXIT_CODE_FILE:-$PWD/.train_exit_codes.$$}
    local forward
    mapfile -t forward < <(compgen -e | grep -E \
        '^(TORCH_NCCL_[A-Z_]+|TORCH_FR_[A-Z_]+|TORCH_DISTRIBUTED_[A-Z_]+|TORCH_CPP_LOG_LEVEL|TRAIN_EXIT_CODE_FILE|WANDB_(PROJECT|ENTITY|MODE|DIR|BASE_URL))$' || true)
    _write_deepspeed_env CUDA_DEVICE_MAX_CONNECTIONS OMP_NUM_THREADS ${forward[@]+"${forward[@]}"}
    local names
    names=$(awk '!/^[[:space:]]*(#|$)/ {print $1}' "$HOSTFILE" | head -n "$NUM_NODES" | paste -sd, -)
    _WHERE=(hosts "$names")
    _run_signalled deepspeed --hostfile "$HOSTFILE" --num_nodes "$NUM_NODES" --num_gpus "$NPROC_PER_NODE" \
        ${MASTER_ADDR:+--master_addr "$MASTER_ADDR"} ${MASTER_PORT:+--master_port "$MASTER_PORT"} "${TRAIN[@]}"
}

# _write_deepspeed_env NAMES...: put NAMES into ./.deepspeed_env, keeping the file's other lines
# (--dry-run: print the lines it would write on stderr, "# .deepspeed_env: ...", and write nothing).
_write_deepspeed_env() {
    local f=.deepspeed_env n lines=() pattern
    pattern="^($(IFS='|'; echo "$*"))="
    [[ -f $f ]] && mapfile -t lines < <(grep -Ev "$pattern" "$f" || true)
    for n in "$@"; do [[ -n ${!n-} ]] && lines+=("$n=${!n}"); done
    if (( DRY_RUN )); then echo "# .deepspeed_env: ${lines[*]-}" >&2; return; fi
    if (( ${#lines[@]} )); then printf '%s\n' "${lines[@]}" >"$f"; else rm -f "$f"; fi
}

# Inside a SLURM job: srun starts one torchrun per node, which starts NPROC_PER_NODE ranks.
# torchrun rather than a hostfile + deepspeed/pdsh: no ssh or pdsh between compute nodes (often
# not allowed), SLURM starts, accounts and kills every rank (scancel, time limit), srun passes the
# whole environment, and the c10d rendezvous on the first node makes the per-node command the same
# on every node. DeepSpeed still runs inside train.py; only its launcher is not used.
launch_srun_torchrun() {
    _parse 2 "RECIPE CONFIG" "$@"; RECIPE=${POS[0]} CONFIG=${POS[1]}; _train
    [[ -n ${SLURM_JOB_ID-} && -n ${SLURM_JOB_NODELIST-} ]] || die "not inside a SLURM job: submit with sbatch"
    command -v scontrol >/dev/null || die "scontrol not found: run inside a SLURM allocation"
    local hosts=()
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    (( ${#hosts[@]} == NUM_NODES )) ||
        die "the job has ${#hosts[@]} nodes, this script needs $NUM_NODES (copy it for another shape)"
    : "${MASTER_ADDR:=${hosts[0]}}" "${MASTER_PORT:=29500}"
    _WHERE=(slurm)
    _run_signalled srun --nodes "$NUM_NODES" --ntasks-per-node 1 --gpus-per-node "$NPROC_PER_NODE" --kill-on-bad-exit=1 \
        torchrun --nnodes "$NUM_NODES" --nproc_per_node "$NPROC_PER_NODE" --rdzv_backend c10d \
        --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID" "${_TORCHRUN_GRACE[@]}" "${TRAIN[@]}"
}
