# The README's two commands: `make demo` (the main job) and `make test`.
# Each creates or reuses .venv by itself (scripts/bootstrap is idempotent).
.PHONY: demo test venv bench

venv:
	@scripts/bootstrap

demo: venv
	@.venv/bin/hsnap demo

test: venv
	@.venv/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: venv
	@.venv/bin/python -m bench.run $(BENCH_ARGS)
	@.venv/bin/python -m bench.resume $(RESUME_ARGS)
