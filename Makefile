# Everything a fresh machine needs: `make demo` and `make test` create (or reuse) .venv and install into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# On the development and CI machines this resolves to a CPU wheel on local disk (seconds, not a GB download).
TORCH  ?= torch==2.13.0
# The oldest and newest Triton of the supported range (pyproject's triton extra): .venv has the oldest, the version
# on the GPU machines; the newest lies beside it in $(TRITON_NEWEST_DIR), put first on PYTHONPATH for a second run
# of the Triton tests.
TRITON_OLDEST := 3.6.0
TRITON_NEWEST := 3.9.0
TRITON_NEWEST_DIR := $(VENV)/triton-newest

.PHONY: demo test health health-newest lint clean gpu-check gpu-cache gpu-tune
# The newest numpy, apart from the venv's: the Triton interpreter the tests use needs numpy < 2.4, the library does
# not (tests/test_info.py runs flashattn with this one).
NEWEST_NUMPY := $(VENV)/newest-numpy

# Installs byte-compile (pip's default): these machines set PYTHONDONTWRITEBYTECODE, so a module left uncompiled is
# compiled again by every process that imports it (the suite took 12 minutes instead of 9 without).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test,plot,triton]" "triton==$(TRITON_OLDEST)"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/flashattn demo --out demo-output

# The CPU kernel's tests again as on a CPU without AVX-512, AVX512_BF16 or AMX (FLASHATTN_CPU_ISA=avx2: an AVX2
# build, the 16-bit dot-product engines hidden), whatever this host has: CI's machines differ between runs. (Their
# Triton cases do not depend on the build: the first run has them.)
AVX2_TESTS := tests/test_cpu_tiles.py tests/test_cpu_tile_choice.py tests/test_cpu_kernel.py tests/test_fp8.py

# torch: pyproject declares torch >= 2.7 (2.6's Dynamo cannot trace the checks under torch.compile). .venv holds 2.13
# (a CPU build on local disk); `make test` also runs the drop-in, compile and distributed tests on the range's ends
# and on the GPU machines' 2.11, each release in a folder of its own put first on PYTHONPATH. PyPI's Linux builds
# are CUDA builds (they run on the CPU): 2.14.1 and its CUDA 13 libraries lie on local disk, 2.11 borrows them,
# 2.7.1 brings its CUDA 12 ones and Triton 3.3 (whose kernels flashattn declines: the triton path's tests skip).
# The C++ CPU kernel is built against the range's ends; on 2.11 (the GPU machines') the torch path serves the CPU.
TORCH_OLDEST := 2.7.1
TORCH_GPU := 2.11.0
TORCH_NEWEST := 2.14.1
TORCH_RANGE := $(TORCH_OLDEST) $(TORCH_GPU) $(TORCH_NEWEST)
TORCH_RANGE_DIR := $(VENV)/torch-range
TORCH_RANGE_TESTS := tests/test_torch_versions.py tests/test_dropin.py tests/test_examples.py
# The distributed tests on the oldest too (its gloo lacks all-to-all and reduce-scatter), without their slowest
# cases (four ranks in float64, the Triton interpreter's), which .venv's torch runs; 2.11 (whose GPU machines run
# the test files themselves) takes the version and drop-in tests only. SDPA's masks and torch.func on the oldest
# too: its Dynamo traces the checks under vmap with fewer builtins.
TORCH_OLDEST_TESTS := $(TORCH_RANGE_TESTS) tests/test_distributed.py tests/test_vmap.py tests/test_sdpa_masks.py
TORCH_RANGE_SKIP := not test_triton_blocks_match_one_device and not 4-float64
TORCH_GPU_TESTS := tests/test_torch_versions.py tests/test_dropin.py

# Two pytest workers on two cores, each torch with two OpenMP threads: idle threads must sleep, not spin (GNU
# OpenMP's default spin took a third of the suite's time: 128 s -> 86 s on the flash_api and kvcache files).
test: export OMP_WAIT_POLICY := PASSIVE

# Every feature test runs on every execution path (the triton kernels under Triton's interpreter, the C++ kernel,
# the tiled torch path) through one fixture, tests/conftest.py's ``path``.
test: $(VENV)/.installed $(NEWEST_NUMPY)/.installed $(TRITON_NEWEST_DIR)/.installed $(TORCH_RANGE_DIR)/.installed
	FLASHATTN_EXPECT_TRITON=$(TRITON_OLDEST) $(PY) -m pytest -n 2 -q -m "not health"
	FLASHATTN_EXPECT_TRITON=$(TRITON_NEWEST) PYTHONPATH=$(TRITON_NEWEST_DIR) $(PY) -m pytest -n 2 -q -m "not health" \
		-p no:cacheprovider -k "triton or ($(TRITON_NEWEST_HEALTH))" $(TRITON_NEWEST_TESTS)
	FLASHATTN_CPU_ISA=avx2 $(PY) -m pytest -n 2 -q -p no:cacheprovider -k "not triton" $(AVX2_TESTS)
	for v in $(TORCH_RANGE); do echo "torch $$v:"; cpu_kernel=1; tests="$(TORCH_RANGE_TESTS)"; \
		[ $$v = $(TORCH_OLDEST) ] && tests="$(TORCH_OLDEST_TESTS)"; \
		[ $$v = $(TORCH_GPU) ] && cpu_kernel=0 && tests="$(TORCH_GPU_TESTS)"; \
		FLASHATTN_CPU_KERNEL=$$cpu_kernel FLASHATTN_EXPECT_TORCH=$$v \
		PYTHONPATH=$(TORCH_RANGE_DIR)/$$v:$(TORCH_RANGE_DIR)/$(TORCH_NEWEST) \
		$(PY) -m pytest -n 2 -q -p no:cacheprovider -k "$(TORCH_RANGE_SKIP)" $$tests || exit 1; done

# The three installs run side by side: unpacking a CUDA build (about 5 GB) keeps a core busy for a minute, and one
# after another they took half of a fresh machine's set-up.
$(TORCH_RANGE_DIR)/.installed: Makefile $(VENV)/.installed
	$(PIP) install -q --upgrade --target $(TORCH_RANGE_DIR)/$(TORCH_NEWEST) "torch==$(TORCH_NEWEST)" & newest=$$!; \
	$(PIP) install -q --upgrade --target $(TORCH_RANGE_DIR)/$(TORCH_OLDEST) "torch==$(TORCH_OLDEST)" & oldest=$$!; \
	$(PIP) install -q --upgrade --no-deps --target $(TORCH_RANGE_DIR)/$(TORCH_GPU) "torch==$(TORCH_GPU)" && \
	wait $$newest && wait $$oldest
	touch $@

# On the newest Triton: the Triton tests (every feature on the interpreted kernels, the shipped tiles, the families)
# and the offline health of the most used calls on sm_100 and gfx942 (`make health-newest`: every family, d = 16
# to 256).
TRITON_NEWEST_HEALTH := largest_common_head_dim and (100 or gfx942) and not gfx1100

# Where the Triton release matters: the kernels' features under the interpreter (packed batches among them), the
# shipped tiles and families compiled (the laden specialization: packed queries, a paged cache, a window), block
# masks; the rest of the suite's triton cases (test_kvcache's and test_varlen's among them) run on the oldest only.
TRITON_NEWEST_TESTS := tests/test_triton.py tests/test_triton_families.py tests/test_kernel_health.py \
	tests/test_block_mask.py tests/test_triton_versions.py \
	tests/test_backends.py flashattn/backends/triton

$(TRITON_NEWEST_DIR)/.installed: Makefile $(VENV)/.installed
	$(PIP) install -q --upgrade --no-deps --target $(TRITON_NEWEST_DIR) "triton==$(TRITON_NEWEST)"
	touch $@

$(NEWEST_NUMPY)/.installed: pyproject.toml $(VENV)/.installed
	$(PIP) install -q --upgrade --no-deps --target $(NEWEST_NUMPY) numpy
	touch $@

# The GPU check (docs/gpu.md), on a machine with a GPU: the kernel smoke against float64, the GPU tests, the headline
# speed against SDPA's backends, decode and block masks, then the CUDA C++ kernel and the wide sweeps while time
# remains, within a time budget (420 s; `python -m tools.gpu_check --budget SECONDS` for another). Its summary and
# archive go into the output folder, benchmarks/results/gpu-check-<device>-<date>/ (or $OUT when set): summary.md,
# gpu-check.json and gpu-check.tgz. Uses .venv when there is one, else the system python (GPU_PY=... names another);
# it needs a CUDA build of torch with triton.
GPU_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	PYTHONPATH=. $(GPU_PY) -m tools.gpu_check

# After gpu-check, on the same GPU: the Triton kernels' configs timed there (within 420 s; docs/gpu.md), the winners
# written as measured-<family>.json into the output folder, for flashattn/backends/triton/measured/.
gpu-tune:
	PYTHONPATH=. $(GPU_PY) -m tools.gpu_tune

# Optional: the Triton kernels the kernel smoke and the headline launch, compiled here without a GPU for sm_90 (H100,
# H200) into .gpu-cache/triton.tgz (and a probe kernel into .gpu-cache/probe), which gpu-check unpacks when the
# checkout it runs from holds them. Not yet hit on an H200 (their keys differ; benchmarks/NOTES.md): an experiment,
# not a saving. The GPU machine's Triton must see the same cache keys: Python 3.12 and the PyPI wheels of triton
# 3.6.0 and torch 2.11 (a CUDA build: a ~4 GB download into $(GPU_CACHE_VENV)); about 6 minutes on 2 cores.
GPU_CACHE_VENV := .venv-gpu-cache
GPU_CACHE_PYTHON ?= python3.12
gpu-cache:
	test -x $(GPU_CACHE_VENV)/bin/python || $(GPU_CACHE_PYTHON) -m venv $(GPU_CACHE_VENV)
	$(GPU_CACHE_VENV)/bin/pip install -q torch==2.11.0 triton==3.6.0 "numpy<2.4" tqdm ninja
	rm -rf .gpu-cache && mkdir -p .gpu-cache
	PYTHONPATH=. $(GPU_CACHE_VENV)/bin/python -m tools.gpu_check.cache --probe .gpu-cache/probe --target 90
	PYTHONPATH=. $(GPU_CACHE_VENV)/bin/python -m tools.gpu_check.cache --build .gpu-cache/triton --target 90
	tar czf .gpu-cache/triton.tgz -C .gpu-cache triton && rm -rf .gpu-cache/triton

# Every shipped Triton config, plain and walking a block mask, compiled offline for every GPU family's
# architectures, sm_75 to sm_120 (no GPU; a few hours on 2 cores from a cold cache: use a larger machine).
health: $(VENV)/.installed
	$(PY) -m pytest -n 2 -q -m health tests/test_kernel_health.py

# The same on the newest Triton of the range, head dims 16 to 256 (every kernel, weight and family): where its
# compiler spills a config that 3.6's did not, `--search` finds the replacement for tables._TRITON_CHANGES.
health-newest: $(VENV)/.installed $(TRITON_NEWEST_DIR)/.installed
	PYTHONPATH=$(TRITON_NEWEST_DIR) $(PY) -m tools.offline.health --head-dims 16,32,64,128,256 --jobs 2

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) demo-output .pytest_cache
