# jobs/common.sh: sourced by every job script in jobs/. Sets up the
# environment and defines `mpidp_run`, which starts one mpidp rank per task
# the right way for the MPI in use, inside Slurm or on a laptop, and
# `mpidp_run_stoppable`, which does the same for a run that must stop in time
# (train): it traps the signals a job may receive and warns the ranks before
# the time limit.
#
# Variables: set them in sbatch's environment (`DATA=pums.h5 TRAIN_ARGS='--epochs 20'
# sbatch --export=ALL jobs/train.sbatch`), or edit the defaults below. Not with
# `--export=ALL,VAR=...`: sbatch splits --export at every comma, so a value
# holding one (`--space lr=0.01,0.05`, `--ranks 1,2`, `--hidden 64,64`) is cut
# there, and the job runs with the part before the comma without a word.
#   MPIDP_VENV        virtualenv to activate (default: the repository's .venv, if any)
#   MPIDP_MPI         mpich | openmpi | cray: the MPI mpi4py is built against
#                     (default mpich: the pip wheel that `pip install mpidp` brings)
#   MPIDP_LAUNCHER    srun | mpiexec (default: srun inside Slurm, mpiexec outside)
#   MPIDP_NTASKS      ranks when running outside Slurm (default 2)
#   MPIDP_GPU         1: GPU job (one rank per GPU, CUDA-aware MPI settings below)
#   MPIDP_SIGNAL_LEAD seconds before the time limit at which mpidp_run_stoppable
#                     sends SIGUSR1 to the ranks (default: a tenth of the job's time
#                     limit, between 10 and 300 s: a 1-minute job is warned 10 s
#                     before its end, a 1-hour job 5 minutes before). A whole number
#                     of seconds, shorter than the job's time left: else the job
#                     stops with exit 2 (a lead as long as the limit would warn the
#                     ranks at once, and every requeued job again)
#   MPIDP_EXIT_FILE   file into which the job writes its exit status when it ends
#                     (`requeued` when it requeued itself); jobs/sweep_scaling.sh
#                     reads it to tell a job that ended well from one that did not
#
# Resource requests: the scripts ask only for --ntasks (and --nodes where the
# layout matters), so that `sbatch --ntasks=N` or `--nodes=N --ntasks=M` on the
# command line replaces them. `--ntasks-per-node` alone cannot raise a script's
# --ntasks (Slurm keeps the smaller count): the scripts stop with a message.
#
# Why these launch lines:
#   srun --mpi=pmi2    MPICH (the pip wheel, or a site MPICH) talks PMI-2 to srun
#   srun --mpi=pmix    Open MPI talks PMIx
#   srun --mpi=cray_shasta   Cray MPICH on HPE/Cray systems
#   plain srun (--mpi=none) starts N singletons of size 1; mpidp refuses to run
#   then (its communicator size disagrees with SLURM_STEP_NUM_TASKS).
#   mpiexec inside the allocation: MPICH's Hydra (and Open MPI's mpirun) read
#   the allocation from Slurm and start the ranks through srun themselves.
#   --kill-on-bad-exit=1 ends the step when any rank fails; mpidp itself also
#   aborts the whole job when a rank raises. Jobs whose ranks may all exit
#   with a non-zero code on purpose (train: 75 = "checkpointed on a signal")
#   set MPIDP_SRUN_END=wait instead: --wait=30 ends the step 30 s after the
#   first rank ends, without killing ranks that are still finalising. (Killed
#   ranks leave a stale PMI socket and MPICH shared memory named after the job
#   and step ids, which a requeued job reuses: its ranks then fail in MPI_Init.
#   mpidp_run_stoppable therefore starts a requeued job with a step that
#   removes MPICH's unused files on every node, which also moves the run to
#   another step id.)

set -o pipefail

# The job's last words, whatever ends it (exit 2 on bad settings too): remove
# the OUT_DIR that made_dir created if it stayed empty, and write the exit status
# to MPIDP_EXIT_FILE (MPIDP_EXIT_NOTE instead, when set: e.g. `requeued`).
MPIDP_MADE_DIR=""
MPIDP_EXIT_NOTE=""
_mpidp_at_exit() {
    local status=$?
    [ -n "$MPIDP_MADE_DIR" ] && rmdir "$MPIDP_MADE_DIR" 2>/dev/null
    [ -n "${MPIDP_EXIT_FILE:-}" ] && echo "${MPIDP_EXIT_NOTE:-$status}" > "$MPIDP_EXIT_FILE"
    return "$status"
}
trap _mpidp_at_exit EXIT

JOBS_DIR="${JOBS_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
REPO_DIR="${REPO_DIR:-$(dirname "$JOBS_DIR")}"
MPIDP_MPI="${MPIDP_MPI:-mpich}"
MPIDP_NTASKS="${MPIDP_NTASKS:-2}"
MPIDP_GPU="${MPIDP_GPU:-0}"
# mpiexec -n abc (or 0) quietly starts one rank, under a banner saying abc
if ! [[ "$MPIDP_NTASKS" =~ ^[0-9]+$ ]] || (( 10#$MPIDP_NTASKS < 1 )); then
    echo "jobs/common.sh: MPIDP_NTASKS=$MPIDP_NTASKS must be a whole number >= 1 (the" \
         "ranks outside Slurm)" >&2
    exit 2
fi
# 5m or 1.5 failed in bash's arithmetic once the job ran ("value too great for
# base"), and the ranks were never warned.
if [ -n "${MPIDP_SIGNAL_LEAD:-}" ]; then
    if ! [[ "$MPIDP_SIGNAL_LEAD" =~ ^[0-9]+$ ]] || (( 10#$MPIDP_SIGNAL_LEAD < 1 )); then
        echo "jobs/common.sh: MPIDP_SIGNAL_LEAD=$MPIDP_SIGNAL_LEAD must be a whole number of" \
             "seconds >= 1 (e.g. 300 for 5 minutes)" >&2
        exit 2
    fi
    MPIDP_SIGNAL_LEAD=$(( 10#$MPIDP_SIGNAL_LEAD ))
fi

# require NAME WHAT: stop the job (exit 2, mpidp's code for bad input) unless
# the variable NAME is set; bash's own ${NAME:?} exits 1. The message names the
# script by MPIDP_SCRIPT (under sbatch, $0 is Slurm's copy, slurm_script).
require() {
    [ -n "${!1:-}" ] && return 0
    echo "${MPIDP_SCRIPT:-$(basename "$0")}: set $1 to $2" >&2
    exit 2
}

# made_dir DIR: create DIR (never its parent) for the job's outputs, and remove
# it again, if still empty, when the job ends (a run refused before writing).
made_dir() {
    [ -d "$1" ] && return 0
    mkdir "$1" || return 1
    MPIDP_MADE_DIR="$1"   # removed at exit if still empty (_mpidp_at_exit)
}

# default_out_dir NAME: where a job puts its outputs when OUT_DIR is not set:
# results/NAME-JOBID in Slurm (the same for a requeued job, which resumes there),
# else results/NAME-local-DATE-PID, a directory of this run's own: two local
# runs never meet in one directory (the second would resume or be refused).
# Creates results/, the scripts' own default place.
default_out_dir() {
    mkdir -p results || return 1
    if [ -n "${SLURM_JOB_ID:-}" ]; then
        echo "results/$1-$SLURM_JOB_ID"
    else
        echo "results/$1-local-$(date +%Y%m%d-%H%M%S)-$$"
    fi
}

if [ -z "${MPIDP_VENV:-}" ] && [ -x "$REPO_DIR/.venv/bin/python" ]; then
    MPIDP_VENV="$REPO_DIR/.venv"
fi
if [ -n "${MPIDP_VENV:-}" ]; then
    # A wrong MPIDP_VENV must stop the job: carrying on would run whatever mpidp
    # (or none) is on PATH.
    if [ ! -f "$MPIDP_VENV/bin/activate" ]; then
        echo "jobs/common.sh: MPIDP_VENV=$MPIDP_VENV is not a virtualenv (no" \
             "$MPIDP_VENV/bin/activate); set it to the environment where mpidp is installed" >&2
        exit 2
    fi
    # shellcheck disable=SC1091
    . "$MPIDP_VENV/bin/activate" || exit 2
fi
if ! command -v mpidp >/dev/null 2>&1; then
    echo "jobs/common.sh: no mpidp on PATH${MPIDP_VENV:+ in $MPIDP_VENV}; install it there" \
         "(make install) or set MPIDP_VENV" >&2
    exit 2
fi
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-${TMPDIR:-/tmp}/mpidp-numba-cache-${USER:-$(id -un)}}"

# Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task: without
# this, each rank of `sbatch --cpus-per-task=8` would get one CPU, and mpidp
# (which runs as many threads as a rank has cores) one thread.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ] && [ -z "${SRUN_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi

if [ -n "${SLURM_JOB_ID:-}" ]; then
    MPIDP_LAUNCHER="${MPIDP_LAUNCHER:-srun}"
else
    MPIDP_LAUNCHER="${MPIDP_LAUNCHER:-mpiexec}"
fi

_per_node="${SLURM_NTASKS_PER_NODE:-}"
_per_node="${_per_node%%[!0-9]*}"
if [ -n "$_per_node" ] && [ -n "${SLURM_NTASKS:-}" ] \
        && [ "$SLURM_NTASKS" -lt $(( _per_node * ${SLURM_JOB_NUM_NODES:-1} )) ]; then
    _wanted=$(( _per_node * ${SLURM_JOB_NUM_NODES:-1} ))
    echo "jobs/common.sh: --ntasks-per-node=$_per_node on ${SLURM_JOB_NUM_NODES:-1} node(s)" \
         "but only $SLURM_NTASKS tasks: the script's --ntasks default caps it; pass" \
         "--ntasks=$_wanted as well" >&2
    exit 2
fi

case "$MPIDP_MPI" in
    mpich)   SRUN_MPI=pmi2 ;;
    openmpi) SRUN_MPI=pmix ;;
    cray)    SRUN_MPI=cray_shasta ;;
    *) echo "jobs/common.sh: MPIDP_MPI must be mpich, openmpi or cray (got '$MPIDP_MPI')" >&2
       exit 2 ;;
esac
SRUN_MPI="${MPIDP_SRUN_MPI:-$SRUN_MPI}"   # override only to test the singleton guard

if [ "$MPIDP_GPU" = 1 ]; then
    # CUDA-aware MPI: device buffers go to MPI directly (mpidp info shows it).
    case "$MPIDP_MPI" in
        cray)    export MPICH_GPU_SUPPORT_ENABLED=1 ;;
        openmpi) export OMPI_MCA_pml=ucx
                 export UCX_TLS="${UCX_TLS:-rc,sm,cuda_copy,cuda_ipc,gdr_copy}" ;;
        mpich)   export MPIR_CVAR_ENABLE_GPU=1 ;;
    esac
fi

# mpi_launcher: the launcher's words (srun ... or mpiexec -n N) in the array MPI_LAUNCHER.
mpi_launcher() {
    if [ "$MPIDP_LAUNCHER" = srun ]; then
        local gpu_flags=()
        [ "$MPIDP_GPU" = 1 ] && gpu_flags=(--gpus-per-task=1 --gpu-bind=single:1)
        local end_flags=(--kill-on-bad-exit=1)
        [ "${MPIDP_SRUN_END:-kill}" = wait ] && end_flags=(--kill-on-bad-exit=0 --wait=30)
        MPI_LAUNCHER=(srun "${end_flags[@]}" --mpi="$SRUN_MPI" "${gpu_flags[@]}")
    else
        MPI_LAUNCHER=(mpiexec -n "${SLURM_NTASKS:-$MPIDP_NTASKS}")
    fi
}

# mpi_run CMD...: run CMD on every rank of the job (one rank per Slurm task).
mpi_run() {
    mpi_launcher
    "${MPI_LAUNCHER[@]}" "$@"
}

# mpidp_run ARGS...: run `mpidp ARGS...` on every rank of the job.
mpidp_run() {
    mpi_run mpidp "$@"
}

# time_left_s: seconds until this Slurm job's time limit (empty: no limit, or no Slurm).
time_left_s() {
    [ -n "${SLURM_JOB_ID:-}" ] || return 0
    local left d=0 h=0 m=0 s=0
    left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null) || return 0
    case "$left" in ""|UNLIMITED|NOT_SET|INVALID) return 0 ;; esac
    if [[ "$left" == *-* ]]; then d=${left%%-*}; left=${left#*-}; fi
    IFS=: read -r -a parts <<< "$left"
    case ${#parts[@]} in
        1) s=${parts[0]} ;;
        2) m=${parts[0]}; s=${parts[1]} ;;
        3) h=${parts[0]}; m=${parts[1]}; s=${parts[2]} ;;
    esac
    echo $(( 10#$d * 86400 + 10#$h * 3600 + 10#$m * 60 + 10#$s ))
}

# The stop signals the batch shell may receive: with --signal=B:USR1@N (to the
# shell only), at the time limit or a plain scancel (TERM), scancel --signal=...
# The trap passes each to the launcher as SIGUSR1, which srun and mpiexec hand
# on to every rank unchanged and mpidp treats like SIGTERM (a checkpoint at the
# next step); srun itself answers a SIGTERM by ending the step, and a first
# SIGINT by printing its status. MPIDP_STOP_SIGNAL says which signal came.
# A signal that comes before the ranks start (during a requeued job's cleanup
# step) is remembered, and the ranks are not started: the run stops at once, as
# killed by that signal (128+n), which train.sbatch treats as any stop.
MPIDP_STOP_SIGNAL=""
_MPIDP_CHILD=""
_MPIDP_PHASE=""   # before | running | after: where mpidp_run_stoppable is
_mpidp_forward() {
    MPIDP_STOP_SIGNAL="$1"
    if [ "$_MPIDP_PHASE" = running ] && [ -n "$_MPIDP_CHILD" ]; then
        echo "mpidp job: $(date -Is) got SIG$1; passing SIG$2 to the ranks"
        kill -s "$2" "$_MPIDP_CHILD" 2>/dev/null
    elif [ "$_MPIDP_PHASE" = after ]; then
        echo "mpidp job: $(date -Is) got SIG$1 after the ranks ended"
    else
        echo "mpidp job: $(date -Is) got SIG$1 before the ranks started"
    fi
    return 0
}

# signal_lead_s LEFT: the lead of the warning for a job with LEFT seconds left
# (MPIDP_SIGNAL_LEAD, else a tenth of LEFT, 10 s to 5 min); fails, with one
# line, when MPIDP_SIGNAL_LEAD is not shorter than LEFT.
signal_lead_s() {
    local left=$1
    if [ -z "${MPIDP_SIGNAL_LEAD:-}" ]; then
        echo $(( left / 10 < 10 ? 10 : (left / 10 > 300 ? 300 : left / 10) ))
    elif (( MPIDP_SIGNAL_LEAD < left )); then
        echo "$MPIDP_SIGNAL_LEAD"
    else
        echo "jobs/common.sh: MPIDP_SIGNAL_LEAD=$MPIDP_SIGNAL_LEAD s is not shorter than the" \
             "job's time left ($left s): the ranks would be warned at once; lower it or" \
             "raise --time" >&2
        return 2
    fi
}

# mpidp_run_stoppable ARGS...: `mpidp ARGS...` on every rank, in the background
# so that the shell's traps run while it trains (bash runs a trap only after the
# foreground command ends). Sends SIGUSR1 MPIDP_SIGNAL_LEAD seconds before the
# job's time limit. Returns mpidp's exit status; 2 (nothing started) for a lead
# not shorter than the time left; 128+n when signal n came before the ranks
# started (they are not started then).
mpidp_run_stoppable() {
    local left lead timer="" status
    local sig
    _MPIDP_PHASE=before
    for sig in USR1 USR2 TERM INT HUP; do
        # shellcheck disable=SC2064  # $sig now, at trap time
        trap "_mpidp_forward $sig USR1" "$sig"
    done
    left=$(time_left_s)
    if [ -n "$left" ]; then
        lead=$(signal_lead_s "$left") || return 2
        echo "mpidp job: time limit in ${left} s; SIGUSR1 to the ranks ${lead} s before it"
        # the timer takes its sleep along when killed (an orphaned sleep would
        # outlive the run, outside Slurm's clean-up)
        ( trap 'kill "$nap" 2>/dev/null; exit 0' TERM
          sleep $(( left - lead )) & nap=$!
          wait "$nap" && kill -s USR1 $$ ) &
        timer=$!
    fi
    if [ "$MPIDP_LAUNCHER" = srun ] && [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
        # One task on each node: -N and -n too, else srun takes the job's task
        # count and warns that it cannot honour --ntasks-per-node=1.
        local nodes="${SLURM_JOB_NUM_NODES:-1}"
        # shellcheck disable=SC2016  # expanded on each node
        srun --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 --mpi=none \
            --kill-on-bad-exit=0 bash -c '
            for f in /dev/shm/mpich_*; do
                [ -O "$f" ] || continue
                grep -qsF "$f" /proc/[0-9]*/maps || rm -f "$f"
            done' || true
    fi
    if [ -n "$MPIDP_STOP_SIGNAL" ]; then
        echo "mpidp job: stopped by SIG$MPIDP_STOP_SIGNAL before the ranks started;" \
             "not starting them"
        [ -n "$timer" ] && kill "$timer" 2>/dev/null
        _MPIDP_PHASE=after
        return $(( 128 + $(kill -l "$MPIDP_STOP_SIGNAL") ))
    fi
    mpi_launcher
    "${MPI_LAUNCHER[@]}" mpidp "$@" &
    _MPIDP_CHILD=$!
    _MPIDP_PHASE=running
    if [ -n "$MPIDP_STOP_SIGNAL" ]; then   # came between the check above and here
        echo "mpidp job: passing SIGUSR1 to the ranks as they start"
        kill -s USR1 "$_MPIDP_CHILD" 2>/dev/null
    fi
    while :; do
        wait "$_MPIDP_CHILD"
        status=$?
        kill -0 "$_MPIDP_CHILD" 2>/dev/null || break   # else a trap interrupted the wait
    done
    if [ "$status" -gt 128 ] && [ -n "$MPIDP_STOP_SIGNAL" ]; then
        wait "$_MPIDP_CHILD" 2>/dev/null   # the wait a trap cut short: the real status
        local again=$?
        [ "$again" -ne 127 ] && status=$again
    fi
    _MPIDP_PHASE=after
    _MPIDP_CHILD=""
    [ -n "$timer" ] && kill "$timer" 2>/dev/null
    return "$status"
}

echo "mpidp job: $(date -Is) host=$(hostname) job=${SLURM_JOB_ID:-local}" \
     "tasks=${SLURM_NTASKS:-$MPIDP_NTASKS} nodes=${SLURM_JOB_NUM_NODES:-1}" \
     "launcher=$MPIDP_LAUNCHER mpi=$MPIDP_MPI gpu=$MPIDP_GPU"
