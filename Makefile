# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# Both create the virtual environment on first use.
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch is pinned to the CPU wheel that lies on local disk; never let pip pick a CUDA build.
	$(VENV)/bin/pip install --quiet 'torch==2.13.0' -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/halfmoon up $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/python -m bench.control_path $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
