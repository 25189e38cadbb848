# The README's two commands: `make demo` (the main job: two real SGLang servers, `hsnap demo`) and `make test`.
# Each creates or reuses .venv by itself (scripts/bootstrap is idempotent).
# `make demo DEMO_ARGS=--json` for the JSON report; `DEMO_ARGS=--library` for the library-level demo.
.PHONY: demo test venv bench

venv:
	@scripts/bootstrap

demo: venv
	@.venv/bin/hsnap demo $(DEMO_ARGS)

test: venv
	@.venv/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: venv
	@.venv/bin/python -m bench.run $(BENCH_ARGS)
	@.venv/bin/python -m bench.resume $(RESUME_ARGS)
	@.venv/bin/python -m bench.server $(SERVER_ARGS)
