PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# RLlib pins its own gymnasium: its tests run in a second venv (cached like the first)
RLLIB_VENV := .venv-rllib
RLLIB_PY := $(RLLIB_VENV)/bin/python
RLLIB_STAMP := $(RLLIB_VENV)/.installed

.PHONY: setup setup-rllib test-rllib demo test lint format bench learning-check plasticity plasticity-ppo findings-bench clean

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (or set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,sb3,recurrent,torchrl,atari,envpool]"
	@touch $(STAMP)

$(RLLIB_STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (or set PYTHON=...)"; exit 1; }
	test -x $(RLLIB_PY) || $(PYTHON) -m venv $(RLLIB_VENV)
	$(RLLIB_PY) -m pip install -q --upgrade pip
	$(RLLIB_PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(RLLIB_PY) -m pip install -q -c constraints.txt -e ".[dev,rllib]"
	@touch $(RLLIB_STAMP)

setup: $(STAMP)

setup-rllib: $(RLLIB_STAMP)

demo: $(STAMP)
	$(PY) -m policy_probes.cli run recipes.cartpole.train trainer.total_timesteps=50000

learning-check: $(STAMP)
	$(PY) -m benchmarks.learning_check --jobs 2

plasticity: $(STAMP)
	nice $(PY) -m benchmarks.plasticity --seeds 1,2,3,4,5 --jobs 2

plasticity-ppo: $(STAMP)
	nice $(PY) -m benchmarks.plasticity_ppo --seeds 1,2,3,4,5

findings-bench: $(STAMP)
	nice $(PY) -m benchmarks.findings_bench --seeds 1,2,3,4 --jobs 2

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint $(RLLIB_STAMP)
	WANDB_MODE=offline WANDB_SILENT=true $(PY) -m pytest
	WANDB_MODE=offline WANDB_SILENT=true $(RLLIB_PY) -m pytest -p no:cacheprovider tests/test_rllib.py

test-rllib: $(RLLIB_STAMP)
	WANDB_MODE=offline WANDB_SILENT=true $(RLLIB_PY) -m pytest -p no:cacheprovider tests/test_rllib.py

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) $(RLLIB_VENV) runs .pytest_cache
