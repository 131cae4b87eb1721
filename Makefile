# relserve build steps. `make serve` and `make test` are the two README commands.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SERVE_ARGS ?=

.PHONY: install install-test proto serve test test-fast bench clean onnx-native bench-onnx gpu-check

# Runtime install: editable package + generated gRPC stubs.
$(BIN)/.relserve-installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -c constraints.txt -e .
	$(BIN)/python -m relserve.service._proto
	touch $@

# Test extras (pytest, transformers as the parity oracle) on top of the runtime install.
$(BIN)/.relserve-test-installed: $(BIN)/.relserve-installed
	$(BIN)/python -m pip install -c constraints.txt -e '.[test]'
	touch $@

install: $(BIN)/.relserve-installed
install-test: $(BIN)/.relserve-test-installed

proto: install
	$(BIN)/python -m relserve.service._proto

serve: install
	$(BIN)/relserve serve $(SERVE_ARGS)

test: install-test
	$(BIN)/python -m pytest -q

# The layers that start no server (unit, models, onnx): the quick loop while editing; `make test` runs them all.
test-fast: install-test
	$(BIN)/python -m pytest -q tests/unit tests/models tests/onnx

bench: install-test
	$(BIN)/python -m relserve.loadtest.bench_encoder

# Native CPU kernels for the com.relserve ONNX custom ops (optional; the exported graphs run without them).
# Downloads Debian trixie's libonnxruntime-dev headers into models/onnx/native/build (private apt config).
onnx-native:
	models/onnx/native/build.sh

# transformers : our torch : ONNX Runtime (portable, and native when built), DeBERTa-v3-base shape, CPU fp32.
bench-onnx: install-test
	$(BIN)/python -m relserve.loadtest.bench_onnx

# On a GPU machine: the CUDA tests (skipped elsewhere), then the encoder and translation ONNX benchmarks.
gpu-check: install-test
	$(BIN)/python -m pytest -q -rs tests/gpu/test_cuda.py
	$(BIN)/python -m relserve.loadtest.bench_onnx --layers 2 --repeats 2
	$(BIN)/python -m relserve.loadtest.bench_onnx_translation --repeats 3

clean:
	rm -rf $(VENV) build *.egg-info service/_proto/*_pb2*.py
