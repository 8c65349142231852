# mpidp: the two commands of the README, and their helpers.
#   make demo   set up .venv, then run the main job on built-in data
#   make test   set up .venv, then run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# torch is pinned to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
STAMP   = $(VENV)/.installed

export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: install demo test clean

install: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check '$(TORCH)' -e '.[test]'
	@touch $@

demo: install
	$(BIN)/mpiexec -n 2 $(BIN)/mpidp info

test: install
	$(BIN)/python tests/run_suite.py

clean:
	rm -rf $(VENV) .numba_cache *.egg-info
