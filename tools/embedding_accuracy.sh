#!/bin/bash
# embedding-mlp (codes file) against logistic regression (one-hot file) on the
# same rows, non-private: two optimizer settings x three seeds, 2 ranks.
# Usage: tools/embedding_accuracy.sh ZIPDIR OUTDIR   (ZIPDIR: the PUMS person zips)
set -euo pipefail
zips=$1 out=$2
bin=${BIN:-.venv/bin}
mkdir -p "$out"
head -c 32 /dev/urandom > "$out/household.secret"  # the same split for both files
for enc in onehot codes; do
  [ -f "$out/income_$enc.h5" ] || $bin/mpiexec -n 2 $bin/mpidp prep "$zips"/*.zip \
    --task income --encoding $enc --household-secret "$out/household.secret" \
    --out "$out/income_$enc.h5" --quiet
done
ls -l "$out"/income_*.h5
printf '%-14s %-28s %s\n' model optimizer "test accuracy (seeds 0 1 2)"
for opt in "--optimizer sgd --lr 0.05" "--optimizer adam --lr 0.001"; do
  for model in logreg embedding-mlp; do
    data=$out/income_onehot.h5
    [ $model = embedding-mlp ] && data=$out/income_codes.h5
    accs=""
    for seed in 0 1 2; do
      acc=$($bin/mpiexec -n 2 $bin/mpidp train --data "$data" --model $model --no-dp \
            --seed $seed --no-progress $opt | sed -n 's/^done: .*test accuracy \([0-9.]*\).*/\1/p')
      accs="$accs $acc"
    done
    printf '%-14s %-28s %s\n' $model "$opt" "$accs"
  done
done
