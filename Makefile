# mpidp: the two commands of the README, and their helpers.
#   make demo   set up .venv, then run the main job on built-in data
#   make test   set up .venv, then run the whole test suite
#   make test-long  the suite with its long tests (docs/testing.md)
#   make test-gpu   on a machine with a GPU: the tests marked gpu (docs/gpus.md)
#   make gpu-check  on a GPU machine without network: tests and benchmarks in < 8 min
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# torch is pinned to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
STAMP   = $(VENV)/.installed

export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: install demo test test-long test-gpu gpu-check clean

install: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check '$(TORCH)' -e '.[test]'
	@touch $@

# The main job on built-in data: a synthetic PUMS person file (official
# format) -> prep on 2 ranks -> the machine's one-time costs (kernel compiles,
# the all-reduce's measurements; cached, so a second demo skips them) -> DP-SGD
# on 2 ranks at epsilon = 1.
DEMO   ?= demo
demo: install
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/mpidp synth --rows 200000 --seed 0 --out $(DEMO)/persons.csv
	$(BIN)/mpiexec -n 2 $(BIN)/mpidp prep $(DEMO)/persons.csv --out $(DEMO)/pums.h5
	$(BIN)/mpiexec -n 2 $(BIN)/mpidp warmup --data $(DEMO)/pums.h5
	$(BIN)/mpiexec -n 2 $(BIN)/mpidp train --data $(DEMO)/pums.h5 --epochs 5 \
	    --target-epsilon 1 --delta 1e-6 --seed 0 --no-progress \
	    --checkpoint-dir $(DEMO)/run --metrics $(DEMO)/run/metrics.jsonl

test: install
	$(BIN)/python tests/run_suite.py

# The whole suite plus the tests marked long (minutes each: Slurm time-limit
# requeue chains, every signal variant), and the fault-injection suite at full size.
test-long: install
	MPIDP_LONG_TESTS=1 $(BIN)/python tests/run_suite.py --stage-timeout 3600
	$(BIN)/python tests/faults.py --runs 56 --seed 1

# The GPU extra matching torch's CUDA (cuda12 or cuda13; GPU_EXTRA=... to choose),
# then every test marked gpu, serially and on 2 ranks; MPIDP_REQUIRE_GPU=1 turns
# their "no GPU" skips into failures.
test-gpu: install
	extra=$${GPU_EXTRA:-cuda$$($(BIN)/python -c 'import torch; print((torch.version.cuda or "12").split(".")[0])')}; \
	    $(BIN)/pip install --quiet --disable-pip-version-check -e ".[test,$$extra]"
	MPIDP_REQUIRE_GPU=1 $(BIN)/python -m pytest tests -m gpu --with-mpi -ra --timeout=900
	MPIDP_REQUIRE_GPU=1 $(BIN)/mpiexec -n 2 $(BIN)/python -m pytest tests -m "gpu and mpi" \
	    --with-mpi -ra --timeout=900

# The GPU check for a machine without network: the image's Python and the wheels
# of tools/gpu_wheels.sh (in .gpu-wheels/), every step time-boxed (docs/gpus.md).
gpu-check:
	tools/gpu_check.sh gpu-check

clean:
	rm -rf $(VENV) .numba_cache *.egg-info $(DEMO)
