# The README's two commands: `make demo` (the main job: two real SGLang servers, `hsnap demo`) and `make test`.
# Each creates or reuses .venv by itself (scripts/bootstrap is idempotent).
# `make demo DEMO_ARGS=--json` for the JSON report.
.PHONY: demo test check venv bench

venv:
	@scripts/bootstrap

demo: venv
	@.venv/bin/hsnap demo $(DEMO_ARGS)

# The gates `make test` runs first (seconds, not minutes): lint for bugs, types on hsnap_format and the plug-in's
# server edge, which way imports may run (.importlinter). Their settings live in pyproject.toml.
check: venv
	@.venv/bin/ruff check --quiet || { echo "make check: ruff found the problems above"; exit 1; }
	@.venv/bin/mypy || { echo "make check: mypy found the type errors above"; exit 1; }
	@.venv/bin/lint-imports --no-cache --no-logo || { echo "make check: an import runs against .importlinter's layers"; exit 1; }

# OMP_WAIT_POLICY: the suite's processes (three workers, their servers) share two cores; OpenMP threads that spin after
# every parallel region take them from each other (measured: 2.8x the CPU time on the engine modules)
test: check
	@OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} .venv/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: venv
	@.venv/bin/python -m bench.run $(BENCH_ARGS)
	@.venv/bin/python -m bench.resume $(RESUME_ARGS)
	@.venv/bin/python -m bench.server $(SERVER_ARGS)
