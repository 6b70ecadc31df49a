# Two entry points for a new user: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-parallel test-fast venv clean

venv: $(STAMP)

# torch/torchvision are pinned here (not in pyproject) to the wheels this
# project is tested with; pyproject declares looser ranges for users elsewhere.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=python3 ...'" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# promtool/prometheus (Debian's prometheus package) back the deploy/ tests. Serial: on 2
# cores the suite is CPU-bound, so two workers saved a sixth and made the load timing-prone
# (docs/BENCHMARKS.md). `make test-parallel` is the same on two xdist workers, the files of
# three or more nodes one after another on one of them (tests/conftest.py).
test: $(STAMP)
	sh deploy/prometheus/ensure-prometheus.sh
	$(PY) -m pytest -q -p no:cacheprovider

test-parallel: $(STAMP)
	sh deploy/prometheus/ensure-prometheus.sh
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder

# Daily work: every pure and single-process test, no etcd, no agents (tests/conftest.py
# marks the rest slow, and fails a test here that starts a process anyway).
test-fast: $(STAMP)
	ELASTIC_TESTS_FAST_ONLY=1 $(PY) -m pytest -q -p no:cacheprovider -m "not slow"

demo: $(STAMP)
	$(VENV)/bin/elastic local --nodes 3 --steps 2000 --faults 2

clean:
	rm -rf $(VENV) *.egg-info
