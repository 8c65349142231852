# jobs/common.sh: sourced by every job script in jobs/. Sets up the
# environment and defines `mpidp_run`, which starts one mpidp rank per task
# the right way for the MPI in use, inside Slurm or on a laptop.
#
# Variables (export them, pass them with `sbatch --export=ALL,VAR=...`, or edit
# the defaults below):
#   MPIDP_VENV        virtualenv to activate (default: the repository's .venv, if any)
#   MPIDP_MPI         mpich | openmpi | cray: the MPI mpi4py is built against
#                     (default mpich: the pip wheel that `pip install mpidp` brings)
#   MPIDP_LAUNCHER    srun | mpiexec (default: srun inside Slurm, mpiexec outside)
#   MPIDP_NTASKS      ranks when running outside Slurm (default 2)
#   MPIDP_GPU         1: GPU job (one rank per GPU, CUDA-aware MPI settings below)
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
#   and step ids, which a requeued job reuses: its ranks then fail.)

set -o pipefail

JOBS_DIR="${JOBS_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
REPO_DIR="${REPO_DIR:-$(dirname "$JOBS_DIR")}"
MPIDP_MPI="${MPIDP_MPI:-mpich}"
MPIDP_NTASKS="${MPIDP_NTASKS:-2}"
MPIDP_GPU="${MPIDP_GPU:-0}"

if [ -z "${MPIDP_VENV:-}" ] && [ -x "$REPO_DIR/.venv/bin/python" ]; then
    MPIDP_VENV="$REPO_DIR/.venv"
fi
if [ -n "${MPIDP_VENV:-}" ]; then
    # shellcheck disable=SC1091
    . "$MPIDP_VENV/bin/activate"
fi
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-${TMPDIR:-/tmp}/mpidp-numba-cache-$USER}"

if [ -n "${SLURM_JOB_ID:-}" ]; then
    MPIDP_LAUNCHER="${MPIDP_LAUNCHER:-srun}"
else
    MPIDP_LAUNCHER="${MPIDP_LAUNCHER:-mpiexec}"
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

# mpi_run CMD...: run CMD on every rank of the job (one rank per Slurm task).
mpi_run() {
    if [ "$MPIDP_LAUNCHER" = srun ]; then
        local gpu_flags=()
        [ "$MPIDP_GPU" = 1 ] && gpu_flags=(--gpus-per-task=1 --gpu-bind=single:1)
        local end_flags=(--kill-on-bad-exit=1)
        [ "${MPIDP_SRUN_END:-kill}" = wait ] && end_flags=(--kill-on-bad-exit=0 --wait=30)
        srun "${end_flags[@]}" --mpi="$SRUN_MPI" "${gpu_flags[@]}" "$@"
    else
        mpiexec -n "${SLURM_NTASKS:-$MPIDP_NTASKS}" "$@"
    fi
}

# mpidp_run ARGS...: run `mpidp ARGS...` on every rank of the job.
mpidp_run() {
    mpi_run mpidp "$@"
}

echo "mpidp job: $(date -Is) host=$(hostname) job=${SLURM_JOB_ID:-local}" \
     "tasks=${SLURM_NTASKS:-$MPIDP_NTASKS} nodes=${SLURM_JOB_NUM_NODES:-1}" \
     "launcher=$MPIDP_LAUNCHER mpi=$MPIDP_MPI gpu=$MPIDP_GPU"
