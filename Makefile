# Everything a fresh machine needs: `make demo` and `make test` create (or reuse) .venv and install into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# On the development and CI machines this resolves to a CPU wheel on local disk (seconds, not a GB download).
TORCH  ?= torch==2.13.0

.PHONY: demo test health lint clean gpu-check

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test,plot,triton]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/flashattn demo --out demo-output

# The CPU tests run twice: on the C++ kernel (the default), then on the tiled PyTorch path that replaces it where
# it cannot be built (FLASHATTN_CPU_KERNEL=0), so both paths are held to the same tests on every feature.
CPU_PATH_TESTS := tests/test_flash_api.py tests/test_varlen.py tests/test_kvcache.py tests/test_sdpa.py \
                  tests/test_autograd.py tests/test_nn.py
test: $(VENV)/.installed
	$(PY) -m pytest -n 2 -q -m "not health"
	FLASHATTN_CPU_KERNEL=0 $(PY) -m pytest -n 2 -q $(CPU_PATH_TESTS)

# On a machine with a GPU: tests, CUDA kernel checks, sweeps against every SDPA backend and FlexAttention, decode,
# kernel health, into one folder under benchmarks/results (commit it). Uses .venv when there is one, else the
# system python (a GPU image with torch and triton and no network).
GPU_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	PYTHONPATH=. $(GPU_PY) -m flashattn gpu-check --out "benchmarks/results/gpu-check-{device}-{date}"

# Every shipped Triton config, plain and walking a block mask, compiled offline for sm_80 and sm_90 (no GPU; ~25
# minutes on 2 cores from a cold cache).
health: $(VENV)/.installed
	$(PY) -m pytest -n 2 -q -m health tests/test_kernel_health.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) demo-output .pytest_cache
