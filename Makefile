# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gradkit-installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU wheel of torch first: any other spec pulls the CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/tiny_gpt.py fit --config examples/configs/demo.yaml --trainer.enable_progress_bar=false

test: $(STAMP)
	$(PY) -m pytest tests -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

bench: $(STAMP)
	$(PY) benchmarks/bench_monitoring.py

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
