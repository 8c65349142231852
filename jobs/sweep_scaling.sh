#!/bin/bash
# jobs/sweep_scaling.sh: a scaling sweep on a Slurm cluster, one job per layout,
# then one table (mpidp bench scaling --collect).
#
# For each layout NODESxTASKS (e.g. the seed project's 4 GPUs as 4x1, 2x2,
# 1x4) it submits jobs/train.sbatch with --nodes=NODES --ntasks-per-node=TASKS,
# its metrics going to OUT/LAYOUT/ (with a sweep-point.json saying what the
# job was), waits for the jobs, and prints the scaling table (time per epoch:
# first and steady, speed-up, comm/compute, accuracy, epsilon, cost with
# --price-per-node-hour in BENCH_ARGS), also written to OUT/scaling.{txt,json,png}.
# One job per size, never ranks left idle inside a bigger job: idle MPI ranks
# busy-wait on cores the timed ranks need. Each layout is measured on nodes
# nothing else uses: its job asks for them --exclusive, and the jobs run one
# after the other (each depends on the previous one ending), so two layouts
# never share a node or the network (--no-exclusive drops the first, for
# sites that forbid it; the second stays).
#
# Usage (from the repository root, or set JOBS_DIR):
#   DATA=pums.h5 bash jobs/sweep_scaling.sh --layouts 1x1,1x2,1x4,2x2,4x1 [--out DIR]
#       [--dry-run] [--no-wait] [--no-exclusive] [--timeout SECONDS]
#       [-- more sbatch options]
# Variables:
#   DATA        prepared HDF5 file (required; a path every node can read)
#   TRAIN_ARGS  mpidp train options of every job
#               (default: --epochs 10 --batch-size 256 --noise-multiplier 1 --seed 1)
#   BENCH_ARGS  more options for mpidp bench scaling --collect (e.g. --price-per-node-hour 12.24)
#   MPIDP_GPU=1 and the others of jobs/common.sh, as for jobs/train.sbatch
# --dry-run prints the sbatch commands and submits nothing; --no-wait submits and
# prints the command that builds the table once the jobs have ended. Exit code:
# 0 when every job wrote metrics, 1 when some did not (their output files are named),
# 2 for bad usage.
set -u -o pipefail

JOBS_DIR="${JOBS_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
LAYOUTS="1x1,1x2"
OUT="results/sweep-$(date +%Y%m%d-%H%M%S)"
DRY_RUN=0
WAIT=1
EXCLUSIVE=(--exclusive)
TIMEOUT=86400
TRAIN_ARGS="${TRAIN_ARGS:---epochs 10 --batch-size 256 --noise-multiplier 1 --seed 1}"
BENCH_ARGS="${BENCH_ARGS:-}"

usage() { sed -n '2,37p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --layouts) LAYOUTS="${2:?--layouts needs a value}"; shift 2 ;;
        --out) OUT="${2:?--out needs a directory}"; OUT_GIVEN=1; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        --no-wait) WAIT=0; shift ;;
        --no-exclusive) EXCLUSIVE=(); shift ;;
        --timeout) TIMEOUT="${2:?--timeout needs seconds}"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) echo "sweep_scaling.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
done
SBATCH_EXTRA=("$@")
if [ "${OUT_GIVEN:-0}" = 1 ] && [ ! -d "$(dirname "$OUT")" ]; then
    # mpidp's rule for outputs: the directory you name is created, never its parent.
    echo "sweep_scaling.sh: --out $OUT: directory $(dirname "$OUT") does not exist" >&2; exit 2
fi
if [ -z "${DATA:-}" ]; then
    echo "sweep_scaling.sh: set DATA to a file written by mpidp prep" >&2; exit 2
fi
IFS=',' read -r -a LAYOUT_LIST <<< "$LAYOUTS"
for layout in "${LAYOUT_LIST[@]}"; do
    if ! [[ "$layout" =~ ^[1-9][0-9]*x[1-9][0-9]*$ ]]; then
        echo "sweep_scaling.sh: layout '$layout' is not NODESxTASKS (e.g. 2x2)" >&2; exit 2
    fi
done

# JSON string (for sweep-point.json): backslashes and double quotes escaped.
json_str() { local s="${1//\\/\\\\}"; printf '"%s"' "${s//\"/\\\"}"; }

JOB_IDS=()
DIRS=()
previous=""
for layout in "${LAYOUT_LIST[@]}"; do
    nodes="${layout%x*}"
    tasks="${layout#*x}"
    dir="$OUT/$layout"
    # --ntasks too: train.sbatch's own --ntasks default would cap --ntasks-per-node.
    after=()
    [ -n "$previous" ] && after=(--dependency=afterany:"$previous")
    cmd=(sbatch --parsable --nodes="$nodes" --ntasks-per-node="$tasks"
         --ntasks=$(( nodes * tasks )) "${EXCLUSIVE[@]}" "${after[@]}"
         --job-name="mpidp-sweep-$layout" --output="$dir/job-%j.out" --export=ALL
         "${SBATCH_EXTRA[@]}" "$JOBS_DIR/train.sbatch")
    if [ "$DRY_RUN" = 1 ]; then
        printf 'DATA=%q OUT_DIR=%q TRAIN_ARGS=%q' "$DATA" "$dir" "$TRAIN_ARGS"
        printf ' %q' "${cmd[@]}"
        printf '\n'
        previous="<job of $layout>"
        continue
    fi
    mkdir -p "$dir" || exit 2
    job=$(DATA="$DATA" OUT_DIR="$dir" TRAIN_ARGS="$TRAIN_ARGS" "${cmd[@]}") || {
        echo "sweep_scaling.sh: sbatch failed for layout $layout" >&2; exit 1; }
    job="${job%%;*}"
    cat > "$dir/sweep-point.json" <<EOF
{"layout": "$layout", "nodes": $nodes, "tasks_per_node": $tasks, "job_id": "$job",
 "scaling": "strong", "train_args": $(json_str "$TRAIN_ARGS"),
 "command": $(json_str "sbatch --nodes=$nodes --ntasks-per-node=$tasks jobs/train.sbatch (TRAIN_ARGS=$TRAIN_ARGS)")}
EOF
    echo "layout $layout: job $job -> $dir${previous:+ (after job $previous)}"
    previous="$job"
    JOB_IDS+=("$job")
    DIRS+=("$dir")
done
[ "$DRY_RUN" = 1 ] && exit 0

COLLECT=(mpidp bench scaling --collect "${DIRS[@]}" --json "$OUT/scaling.json"
         --plot "$OUT/scaling.png")
if [ "$WAIT" = 0 ]; then
    echo "when the jobs have ended: ${COLLECT[*]} $BENCH_ARGS"
    exit 0
fi

# Poll the queue (sbatch --wait reports 0 for a job cancelled while pending).
ids=$(IFS=','; echo "${JOB_IDS[*]}")
deadline=$(( $(date +%s) + TIMEOUT ))
while [ -n "$(squeue -h -j "$ids" -o %i 2>/dev/null)" ]; do
    if [ "$(date +%s)" -gt "$deadline" ]; then
        echo "sweep_scaling.sh: jobs $ids still queued after $TIMEOUT s; cancelling" >&2
        scancel "${JOB_IDS[@]}"
        exit 1
    fi
    sleep "${SWEEP_POLL_SECONDS:-5}"
done

# shellcheck disable=SC1091
. "$JOBS_DIR/common.sh" >/dev/null || exit 2   # the venv that has mpidp
done_dirs=()
status=0
for dir in "${DIRS[@]}"; do
    if [ -s "$dir/metrics.jsonl" ]; then
        done_dirs+=("$dir")
    else
        echo "sweep_scaling.sh: no metrics in $dir; see $dir/job-*.out" >&2
        status=1
    fi
done
[ "${#done_dirs[@]}" -eq 0 ] && exit 1
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
mpidp bench scaling --collect "${done_dirs[@]}" --json "$OUT/scaling.json" \
    --plot "$OUT/scaling.png" $BENCH_ARGS | tee "$OUT/scaling.txt" || exit 1
exit "$status"
