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
# Usage (from any directory; relative paths are the jobs' too):
#   DATA=pums.h5 bash jobs/sweep_scaling.sh --layouts 1x1,1x2,1x4,2x2,4x1 [--out DIR]
#       [--resume] [--dry-run] [--no-wait] [--no-exclusive] [--timeout SECONDS]
#       [-- more sbatch options]
# --out (default results/sweep-DATE-TIME) must not hold a sweep already: its
# jobs would resume the runs there, whatever TRAIN_ARGS says. --resume submits
# into it all the same, to finish a sweep whose jobs stopped (same TRAIN_ARGS;
# each job continues the run in its layout's directory).
# Variables:
#   DATA        prepared HDF5 file (required; a path every node can read)
#   TRAIN_ARGS  mpidp train options of every job
#               (default: --epochs 10 --batch-size 256 --noise-multiplier 1 --seed 1)
#   BENCH_ARGS  more options for mpidp bench scaling --collect (e.g. --price-per-node-hour 12.24)
#   MPIDP_GPU=1 and the others of jobs/common.sh, as for jobs/train.sbatch
# --dry-run prints the sbatch commands and submits nothing; --no-wait submits and
# prints the command that builds the table once the jobs have ended. Every option
# and variable is checked before the first sbatch. Exit code: 0 when every job
# ended well (exit 0, which it writes to OUT/LAYOUT/exit-code: MPIDP_EXIT_FILE
# of jobs/common.sh) and wrote metrics, 1 when some did not (named with their
# output files; the table holds the others), 2 for bad usage (one line, nothing
# submitted).
set -u -o pipefail

JOBS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"   # beside train.sbatch
LAYOUTS="1x1,1x2"
OUT="results/sweep-$(date +%Y%m%d-%H%M%S)"
DRY_RUN=0
WAIT=1
RESUME=0
EXCLUSIVE=(--exclusive)
TIMEOUT=86400
TRAIN_ARGS="${TRAIN_ARGS:---epochs 10 --batch-size 256 --noise-multiplier 1 --seed 1}"
BENCH_ARGS="${BENCH_ARGS:-}"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
# bad_usage WHAT: one line, exit 2, before anything is submitted.
bad_usage() { echo "sweep_scaling.sh: $*" >&2; exit 2; }
# value OPTION WHAT ARGS...: fails unless OPTION has a value (the next word).
value() {
    [ $# -ge 3 ] && [[ "$3" != --* ]] || bad_usage "$1 needs $2 (see --help)"
}
while [ $# -gt 0 ]; do
    case "$1" in
        --layouts) value "$1" "a list of NODESxTASKS" "${@:2}"; LAYOUTS="$2"; shift 2 ;;
        --out) value "$1" "a directory" "${@:2}"; OUT="$2"; OUT_GIVEN=1; shift 2 ;;
        --timeout) value "$1" "seconds" "${@:2}"; TIMEOUT="$2"; shift 2 ;;
        --resume) RESUME=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --no-wait) WAIT=0; shift ;;
        --no-exclusive) EXCLUSIVE=(); shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) bad_usage "unknown option '$1' (see --help)" ;;
    esac
done
SBATCH_EXTRA=("$@")
if ! [[ "$TIMEOUT" =~ ^[0-9]+$ ]] || (( 10#$TIMEOUT < 1 )); then
    bad_usage "--timeout $TIMEOUT is not a whole number of seconds >= 1 (e.g. 36000 for 10 hours)"
fi
TIMEOUT=$(( 10#$TIMEOUT ))
if [ "${OUT_GIVEN:-0}" = 1 ] && [ ! -d "$(dirname "$OUT")" ]; then
    # mpidp's rule for outputs: the directory you name is created, never its parent.
    bad_usage "--out $OUT: directory $(dirname "$OUT") does not exist"
fi
if [ "$RESUME" = 0 ]; then
    for held in "$OUT"/scaling.json "$OUT"/*/sweep-point.json; do
        [ -e "$held" ] || continue
        bad_usage "--out $OUT already holds a sweep ($held): give a new --out, or" \
                  "--resume to finish that sweep with the same TRAIN_ARGS"
    done
fi
[ -n "${DATA:-}" ] || bad_usage "set DATA to a file written by mpidp prep"
IFS=',' read -r -a LAYOUT_LIST <<< "$LAYOUTS"
[ "${#LAYOUT_LIST[@]}" -gt 0 ] || bad_usage "--layouts is empty (e.g. 1x1,1x2)"
seen=","
for layout in "${LAYOUT_LIST[@]}"; do
    if ! [[ "$layout" =~ ^[1-9][0-9]*x[1-9][0-9]*$ ]]; then
        bad_usage "layout '$layout' is not NODESxTASKS (e.g. 2x2)"
    fi
    [[ "$seen" == *",$layout,"* ]] && bad_usage "layout $layout is given twice (one directory each)"
    seen+="$layout,"
done
# The jobs' own settings (MPIDP_VENV, MPIDP_MPI, MPIDP_SIGNAL_LEAD, ...): checked
# here by jobs/common.sh, in a subshell, rather than in every job.
( set +u; . "$JOBS_DIR/common.sh" ) >/dev/null || exit 2

# JSON string (for sweep-point.json): backslashes and double quotes escaped.
json_str() { local s="${1//\\/\\\\}"; printf '"%s"' "${s//\"/\\\"}"; }

# A table of an earlier sweep (--resume) would outlive jobs that now fail.
[ "$DRY_RUN" = 1 ] || rm -f "$OUT/scaling.txt" "$OUT/scaling.json" "$OUT/scaling.png"
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
    # the job writes its exit status there: how the sweep tells a job that ended
    # well from one that failed (metrics alone may be an earlier run's)
    exit_file="$dir/exit-code"
    if [ "$DRY_RUN" = 1 ]; then
        printf 'DATA=%q OUT_DIR=%q TRAIN_ARGS=%q MPIDP_EXIT_FILE=%q' "$DATA" "$dir" \
            "$TRAIN_ARGS" "$exit_file"
        printf ' %q' "${cmd[@]}"
        printf '\n'
        previous="<job of $layout>"
        continue
    fi
    mkdir -p "$dir" || exit 2
    rm -f "$exit_file"
    job=$(DATA="$DATA" OUT_DIR="$dir" TRAIN_ARGS="$TRAIN_ARGS" MPIDP_EXIT_FILE="$exit_file" \
          JOBS_DIR="$JOBS_DIR" "${cmd[@]}") || {
        echo "sweep_scaling.sh: sbatch failed for layout $layout" >&2; exit 1; }
    job="${job%%;*}"
    cat > "$dir/sweep-point.json" <<EOF
{"layout": "$layout", "nodes": $nodes, "tasks_per_node": $tasks, "job_id": "$job",
 "scaling": "strong", "train_args": $(json_str "$TRAIN_ARGS"),
 "command": $(json_str "sbatch --nodes=$nodes --ntasks-per-node=$tasks jobs/train.sbatch \
(TRAIN_ARGS=$TRAIN_ARGS)")}
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
for i in "${!DIRS[@]}"; do
    dir="${DIRS[$i]}"
    job="${JOB_IDS[$i]}"
    code=$(cat "$dir/exit-code" 2>/dev/null)
    if [ "$code" = 0 ] && [ -s "$dir/metrics.jsonl" ]; then
        done_dirs+=("$dir")
        continue
    fi
    case "$code" in
        0) why="wrote no metrics" ;;
        "") why="ended without an exit status (cancelled, or killed)" ;;
        requeued) why="was requeued and did not run again" ;;
        *) why="failed (exit $code)" ;;
    esac
    echo "sweep_scaling.sh: layout ${LAYOUT_LIST[$i]}: job $job $why; left out of the" \
         "table; see $dir/job-$job.out" >&2
    status=1
done
[ "${#done_dirs[@]}" -eq 0 ] && exit 1
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
mpidp bench scaling --collect "${done_dirs[@]}" --json "$OUT/scaling.json" \
    --plot "$OUT/scaling.png" $BENCH_ARGS | tee "$OUT/scaling.txt" || exit 1
exit "$status"
