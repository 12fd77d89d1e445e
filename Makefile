# make demo: the main job (CPU server; bf16, kivi4 and kivi2 on multi-turn ShareGPT). make test: the suite CI runs.
# make check: the loop before each commit (under a minute). All build the CPU venv first (scripts/setup_env.sh;
# ~5 min once, then a stamp check of ~0.1 s).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test check demo

setup:
	KVQ_VENV=$(abspath $(VENV)) bash scripts/setup_env.sh

# -n: TEST_WORKERS pytest-xdist workers, each taking whole test files (--dist loadfile: a module's servers start
# once; tests/conftest.py keeps the conformance modules on one worker). Much of the suite waits on one core (the
# Triton interpreter, a server's scheduler, imports), which the second worker fills. Matrices run one
# representative case; KVQ_TEST_MATRIX=all runs every case (docs/development.md, Tests).
# --timeout: a hung engine test fails after 20 min instead of eating CI's budget. pytest exits 5 when it collected
# no tests: say so, and fail.
TEST_WORKERS ?= 2
test: setup
	@rc=0; $(PY) -m pytest -q -ra --durations=25 --timeout=1200 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) \
	  || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

# Lint, the layer contract (pyproject.toml's [tool.importlinter]), the generated blocks against their sources (README's decision summaries, docs/decision*.md, the conformance
# tables, the knob table, every committed PNG has a redraw) and the fast unit tests.
CHECK_TESTS := tests/project/test_readme.py tests/tools/test_decision.py tests/tools/test_conformance_offline.py \
  tests/tools/test_cli.py tests/unit/test_config.py tests/unit/test_layout.py tests/unit/test_formats.py \
  tests/unit/test_plan.py tests/unit/test_quant_kivi.py tests/tools/test_plots.py
check: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -n 0 -p no:cacheprovider --timeout=120 $(CHECK_TESTS)

# DEMO_ARGS: e.g. --json FILE to keep the measurements (sgl-kvq demo --help)
DEMO_ARGS ?=
demo: setup
	$(VENV)/bin/sgl-kvq demo $(DEMO_ARGS)
