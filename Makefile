# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# The oracle stack is test-only: torch (CPU wheel), transformers, pillow, and NeMo AutoModel's V4.1
# port installed with --no-deps because its pins conflict with ours.
ORACLE := torch==2.13.0 "transformers>=5.18,<6" pillow
NEMO := nemo-automodel==0.7.0
# pytest-xdist processes for `make test`; each test file runs whole in one of them (module fixtures compile once),
# longest files first (tests/conftest.py orders the collection; xdist keeps that order with --no-loadscope-reorder).
TEST_WORKERS ?= 2

.PHONY: demo test bench checkpoint train clean kernels cluster-demo

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install -e ".[test,train]" $(ORACLE)
	$(PIP) install --no-deps $(NEMO)
	touch $@

demo: $(VENV)/.runtime
	$(PY) examples/offline_inference.py

cluster-demo: $(VENV)/.test
	$(PY) examples/cluster_demo.py

test: $(VENV)/.test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20

bench: $(VENV)/.test
	$(PY) benchmarks/startup.py
	$(PY) benchmarks/forward.py
	$(PY) benchmarks/decode.py
	$(PY) benchmarks/offline_throughput.py
	$(PY) benchmarks/prefix_cache.py
	$(PY) benchmarks/recipe.py
	$(PY) benchmarks/structured.py
	$(PY) benchmarks/eplb.py
	$(PY) benchmarks/kernels.py
	$(PY) benchmarks/dp_engine.py
	$(PY) benchmarks/spec_decode.py
	$(PY) benchmarks/serve.py
	$(PY) benchmarks/batch.py

# Regenerate the shipped seeded random `small` checkpoint (deterministic).
checkpoint: $(VENV)/.runtime
	$(PY) -m deepinfer_jax.checkpoint.make_random checkpoints/small-random --preset small --seed 0

clean:
	rm -rf $(VENV) .jax_cache .jax_cache-* .pytest_cache

# Retrain the default checkpoint from scratch (~38 min training + ~6 min evaluation on 2 cores), rewrite its card.
train: $(VENV)/.test
	$(PY) examples/train_small.py

# Build the optional CUDA custom calls (XLA FFI handlers) into custom_calls/build; needs nvcc and cmake.
CUDA_ARCHS ?= 90a;100a
kernels: $(VENV)/.runtime
	cmake -S custom_calls -B custom_calls/build -DPython_EXECUTABLE=$(abspath $(PY)) "-DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHS)"
	cmake --build custom_calls/build -j2
