#!/usr/bin/env bash
# The utility figures of docs/privacy.md: DP-SGD on the ten states' PUMS person files,
# employment and income, three seeds each, delta = 1e-5, at each epsilon of EPSILONS
# (default "1"), with
#   pld        sigma calibrated with the PLD accountant (the default)
#   rdp        the same recipe, sigma calibrated with RDP (more noise)
#   household  pld, --privacy-unit household (epsilon per household)
# and nondp, the same recipe without clipping and noise (reference).
# Usage: [EPSILONS="1 0.25"] tools/privacy_utility.sh PUMS_ZIP_DIR OUT_DIR [RANKS]
# Runs what is missing in OUT_DIR, then prints the table.
set -euo pipefail
zips=${1:?folder of csv_p*.zip}; out=${2:?output folder}; ranks=${3:-2}
epsilons=${EPSILONS:-1}
bin=$(dirname "$0")/../.venv/bin
mkdir -p "$out"
recipe=(--epochs 10 --batch-size 256 --lr 0.05 --max-grad-norm 1 --hidden 128,128
        --delta 1e-5 --no-progress)
train() {  # name, options...
  local name=$1; shift
  [ -s "$out/$name.jsonl" ] && return
  "$bin/mpiexec" -n "$ranks" "$bin/mpidp" train "${recipe[@]}" --metrics "$out/$name.part" \
      "$@" > "$out/$name.log"
  mv "$out/$name.part" "$out/$name.jsonl"
}
for task in employment income; do
  [ -f "$out/$task.h5" ] || "$bin/mpiexec" -n "$ranks" "$bin/mpidp" prep "$zips"/csv_p*.zip \
      --task "$task" --seed 0 --out "$out/$task.h5"
  for seed in 0 1 2; do
    data=(--data "$out/$task.h5" --seed "$seed")
    train "$task-nondp-$seed" "${data[@]}" --no-dp
    for eps in $epsilons; do
      train "$task-pld-eps$eps-$seed" "${data[@]}" --target-epsilon "$eps" --accountant pld
      train "$task-rdp-eps$eps-$seed" "${data[@]}" --target-epsilon "$eps" --accountant rdp
      train "$task-household-eps$eps-$seed" "${data[@]}" --target-epsilon "$eps" \
          --accountant pld --privacy-unit household
    done
  done
done
EPSILONS="$epsilons" "$bin/python" - "$out" <<'PY'
import json, os, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def last(name):
    return json.loads(Path(out, name + ".jsonl").read_text().splitlines()[-1])
print(f"{'task':<11} {'run':<10} {'epsilon':>7} {'sigma':>7} {'test accuracy, seeds 0 1 2':<27} "
      f"{'mean':>7}")
for task in ("employment", "income"):
    runs = [(f"{run}", eps, f"{run}-eps{eps}") for eps in os.environ["EPSILONS"].split()
            for run in ("pld", "rdp", "household")] + [("nondp", "-", "nondp")]
    for run, eps, stem in runs:
        rows = [last(f"{task}-{stem}-{seed}") for seed in (0, 1, 2)]
        acc = [r["test_accuracy"] for r in rows]
        sigma = rows[0]["noise_multiplier"]
        print(f"{task:<11} {run:<10} {eps:>7} {'-' if sigma is None else f'{sigma:.4f}':>7} "
              f"{' '.join(f'{a:.4f}' for a in acc):<27} {statistics.mean(acc):>7.4f}")
PY
