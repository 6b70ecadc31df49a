# Two entry points for a new user: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-tools test-serial test-fast test-profile lint venv clean

venv: $(STAMP)

# torch/torchvision are pinned here (not in pyproject) to the wheels this
# project is tested with; pyproject declares looser ranges for users elsewhere.
# pip installs one wheel at a time on one core; torch's CUDA build is a dozen wheels (2.7 GB).
# deploy/venv_install.py resolves them once with pip, then runs one pip per core on its share:
# 29 s instead of 39-40 (2026-12-03, 2 cores; docs/BENCHMARKS.md). Then pip is upgraded: pip 26
# resolves the project's dev extras in half the time of Python 3.11's pip 23 (11 s against 23,
# the same 80 packages), but unpacked torch's wheels slower (46 s against 28), so it comes after.
# pip byte-compiles on one core: what is installed so far (torch and what it imports) is compiled on
# every core while pip installs the rest, the rest after, beside `make lint`. The bytecode is needed: where
# PYTHONDONTWRITEBYTECODE is set, each process would compile torch again. compileall's
# errors are files for other Pythons (torch's py312_intrinsics.py), which pip skips too.
SITE := $(VENV)/lib/python3.11/site-packages
INSTALLED := $(VENV)/.packages
$(INSTALLED): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=python3 ...'" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) deploy/venv_install.py torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q --no-compile 'pip>=26.3'
	$(PY) -m compileall -q -j0 $(SITE) >/dev/null 2>&1 & \
	  $(PY) -m pip install -q --no-compile -e '.[dev]'; status=$$?; wait; exit $$status
	touch $(INSTALLED)

$(STAMP): $(INSTALLED)
	$(PY) -m compileall -q -j0 $(SITE) >/dev/null || true
	touch $(STAMP)

# promtool/prometheus (Debian's prometheus package) back the deploy/ tests. Three pytest-xdist
# workers: the heaviest multi-node files one after another on one of them, every other file
# on the other two (tests/conftest.py). Measured on 2 cores (docs/BENCHMARKS.md): 14 min for
# 1165 tests (2026-11-27), against 17-18 min on two workers the same day and 29 serially: the
# tests wait (leases, recoveries) about a third of the time, and a third worker fills it.
# 20.5 min for 1496 tests (2026-12-02; 25.8 before the agents and the tests' ranks were forked
# from a zygote): the suite is CPU-bound, `make test-profile` says where.
# 12.6 min for 1640 tests (2026-12-02, third stop: 13.7 with a fresh venv and lint), after a
# finished node stopped holding a returning one for 30 s (docs/BENCHMARKS.md).
# 13-15 min for 1659 tests (2026-12-02, fourth stop: 14:21-16:16 with a fresh venv and lint).
# 16-17 min for 1689 tests (2026-12-03: 17:32-18:24 in all) on a host a fifth slower than the day
# before, which ran the same suite in 13:54-14:10 (docs/BENCHMARKS.md, issue 50's eighth stop).
# 14:45-16:29 for 1693 tests (2026-12-03, ninth stop: 16:00-17:53 in all, the venv 65-70 s of it).
# 13:13-15:02 for 1697 tests (2026-12-03, tenth stop: 15:14-16:32 in all; docs/BENCHMARKS.md).
# 12:07-13:35 for 1700 tests (2026-12-03, eleventh stop: 13:28-15:15 in all, the files longest
# first, 13-18 s less before pytest; docs/BENCHMARKS.md).
# 10:57-11:56 for 1700 tests (2026-12-03, twelfth stop: 11:42-13:51 in all, three quiet greens
# in a row; 15:46 in all beside two busy processes, green).
# compileall first: where PYTHONDONTWRITEBYTECODE is set (as on these machines) no process
# writes bytecode, so each of the suite's interpreter starts (agents, CLIs, torchrun) would
# compile the project's modules again (~0.2 s of CPU each); compiled once, they all read it.
# `make test-serial` runs one test at a time. PYTEST_ARGS adds pytest options to either
# (e.g. PYTEST_ARGS=--junitxml=times.xml for every test's time).
PYTEST_ARGS ?=
# The Debian packages install beside the venv (-j3): apt waits on the disk and the network
# while pip works, so their seconds on a fresh machine are hidden; lint (mypy, one core) runs
# beside the last byte-compile of the venv, which needs no more than the packages installed.
test:
	$(MAKE) --no-print-directory -j3 lint test-tools $(STAMP)
	$(PY) -m compileall -q elastic agent checkpoints tests bench >/dev/null
	$(PY) -m pytest -q -p no:cacheprovider -n 3 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-tools:
	sh deploy/prometheus/ensure-prometheus.sh
	sh tests/support/ensure-libfaketime.sh

test-serial: $(STAMP) test-tools
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# What each test costs: wall, CPU of everything it started (a cgroup per test), processes
# started and torch imports (a .pth hook in the venv, inert unless the profile sets its log),
# summed by kind into PROFILE_DIR/report.md (docs/BENCHMARKS.md keeps the latest).
# `python -m tests.support.suite_profile asserts --compare REV` lists any check dropped since REV.
PROFILE_DIR ?= /tmp/elastic-test-profile
test-profile: $(STAMP) test-tools
	cp tests/support/proc_probe.py $(SITE)/_elastic_proc_probe.py
	echo "import _elastic_proc_probe" > $(SITE)/elastic-proc-probe.pth
	rm -rf $(PROFILE_DIR) && mkdir -p $(PROFILE_DIR)
	$(PY) -m compileall -q elastic agent checkpoints tests bench >/dev/null
	ELASTIC_PROFILE_OUT=$(PROFILE_DIR) $(PY) -m pytest -q -p no:cacheprovider -p tests.support.profile_plugin \
		-n 3 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) || true
	$(PY) -m tests.support.suite_profile report $(PROFILE_DIR) | tee $(PROFILE_DIR)/report.md

# ruff (bugs: pyflakes, bugbear, ...) and mypy, configured in pyproject.toml; `make test` runs
# it first. A few seconds once mypy's cache (.mypy_cache) is warm.
lint: $(INSTALLED)
	$(VENV)/bin/ruff check --quiet elastic agent checkpoints tests bench deploy
	$(VENV)/bin/mypy

# Daily work: every pure and single-process test, no etcd, no agents (tests/conftest.py
# marks the rest slow, and fails a test here that starts a process anyway).
test-fast: $(STAMP)
	ELASTIC_TESTS_FAST_ONLY=1 $(PY) -m pytest -q -p no:cacheprovider -m "not slow"

demo: $(STAMP)
	$(VENV)/bin/elastic local --nodes 3 --steps 2000 --faults 2

clean:
	rm -rf $(VENV) *.egg-info
