# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch's CPU wheel: pinned in pyproject's test extra; PIP_FIND_LINKS lets pip take a local copy when one exists.
TORCH_WHEELS ?= /opt/wheels

.PHONY: install test demo crds tiny-model bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	PIP_FIND_LINKS=$(TORCH_WHEELS) $(PIP) install --quiet -c constraints.txt -e ".[operator,trainer,test]"
	touch $@

install: $(VENV)/.installed

# vLLM's LoRA loader for the adapter tests, beside the venv's packages (not in them): installed
# without its dependencies, which would pull a CUDA torch; see tests/adapters/vllm-requirements.txt.
$(VENV)/.vllm-installed: tests/adapters/vllm-requirements.txt $(VENV)/.installed
	rm -rf $(VENV)/vllm-pkgs
	$(PIP) install --quiet --no-deps --target $(VENV)/vllm-pkgs -r tests/adapters/vllm-requirements.txt
	touch $@

test: install $(VENV)/.vllm-installed
	$(PY) -m pytest -q

crds: install
	$(VENV)/bin/lora-operator crds --out crds --out charts/lora-operator/crds
	$(VENV)/bin/lora-operator docs --out docs/reference

examples/tiny-llama/config.json: install
	$(PY) examples/make_tiny_model.py --out examples/tiny-llama

tiny-model: examples/tiny-llama/config.json

demo: tiny-model
	$(VENV)/bin/lora-operator run-local -f examples/lora-finetune.yaml

# Benchmarks are run by hand (never in tests); each rewrites its own section of docs/benchmarks.md.
bench: install
	$(PY) bench/operator_latency.py
	$(PY) bench/train_throughput.py
	$(PY) bench/adapter_convert.py

clean:
	rm -rf $(VENV) examples/tiny-llama examples/output
