# Everything runs from the project's virtual environment, made on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test demo serve protos checkpoints clean

venv: $(STAMP)

# torch is pinned to the CPU build that pip finds locally (see README); the
# `dev` extra brings the test tools and the openai client.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q

demo: venv
	$(PY) scripts/stack.py demo

serve: venv
	$(PY) scripts/stack.py serve

protos: venv
	$(PY) scripts/gen_protos.py

checkpoints: venv
	$(PY) -m shared.checkpoints --out checkpoints

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
