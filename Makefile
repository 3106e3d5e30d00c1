PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint format bench learning-check plasticity plasticity-ppo clean

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (or set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,sb3,recurrent,torchrl,atari,envpool]"
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m policy_probes.cli run recipes.cartpole.train trainer.total_timesteps=50000

learning-check: $(STAMP)
	$(PY) -m benchmarks.learning_check --jobs 2

plasticity: $(STAMP)
	nice $(PY) -m benchmarks.plasticity --seeds 1,2,3,4,5 --jobs 2

plasticity-ppo: $(STAMP)
	nice $(PY) -m benchmarks.plasticity_ppo --seeds 1,2,3,4,5

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	WANDB_MODE=offline WANDB_SILENT=true $(PY) -m pytest

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) runs .pytest_cache
