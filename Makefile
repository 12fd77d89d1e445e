# make demo: the main job (CPU server, kivi2 vs bf16 on multi-turn ShareGPT). make test: the whole suite.
# Both build the CPU venv first (scripts/setup_env.sh; ~5 min once, then a stamp check of ~0.1 s).
VENV ?= .venv
PY := $(VENV)/bin/python
# CI runs the slow end-to-end tests too; narrow locally with e.g. make test PYTEST_ARGS='-m "not slow"'.
PYTEST_ARGS ?=

.PHONY: setup test demo

setup:
	KVQ_VENV=$(abspath $(VENV)) bash scripts/setup_env.sh

# --timeout: a hung engine test fails after 20 min instead of eating the CI budget (later PYTEST_ARGS win).
# --durations: the 25 slowest tests, so a CI log shows what to trim: the target is 45 minutes; run serially,
# the suite took 68 min (1,293 tests) on the 2-core AVX2 dev machine of 2026-11-27 (its CI: 67).
# -n: TEST_WORKERS pytest-xdist workers, each taking whole test files (--dist loadfile: a module's servers are
# started once; tests/conftest.py keeps the conformance modules, which share their servers, on one worker). Much of the suite waits on one core (the Triton interpreter, a server's scheduler, imports), so two
# workers on two cores overlap it; TEST_WORKERS=0 runs in this process. pytest exits 5 when it collected no tests:
# say so, and fail.
TEST_WORKERS ?= 2
test: setup
	@rc=0; $(PY) -m pytest -q -ra --durations=25 --timeout=1200 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) \
	  || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

demo: setup
	$(VENV)/bin/sgl-kvq demo
