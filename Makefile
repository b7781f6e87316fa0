# FreeToken developer entry points.
#   make test   set up everything on a fresh machine (venv, torch, all packages, native
#               builds, the ROCm compiler when root), run the test suite, run the CPU
#               backend's tests again with the kernel tier capped to avx2 and the kernel
#               tests capped to scalar (make test-tiers), then build the wheels and check
#               them in fresh venvs (what make wheel-check does)
#   make test-tiers   only the capped runs: whatever this machine's processor, the avx2 tier
#                     (most consumer desktops) and the scalar tier run as the active tier
#   make run    set up, then serve the built-in demo model on http://127.0.0.1:8000
#   make wheels       the five distributions as sdists and wheels in dist/ (each wheel built
#                     from its sdist; unchanged ones reused)
#   make wheel-check  make wheels, then install them into fresh venvs (freetoken,
#                     freetoken[cuda], freetoken[rocm], freetoken-core alone) and run them
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
# Our packages: installed from their paths, editable, never from an index.
PKGS := -e ./freetoken-core -e ./freetoken-cpu-moe -e ./freetoken-cuda -e ./freetoken-rocm -e ./tests/plugins/freetoken-fakegpu
PYTEST_ARGS ?=

# The CPU backend's tests (kernels, engines on the CPU backend, the model families) and the
# kernel tests alone, run again under FREETOKEN_CPU_MOE_ISA (a cap on the kernel tier).
CPU_BACKEND_TESTS := tests/cpu_moe tests/engine tests/models_moe_families
KERNEL_TESTS := tests/cpu_moe

.PHONY: test test-tiers run setup venv toolchain install wheels wheel-check clean

BUILD_WHEELS := $(VPY) tests/packaging/build_wheels.py
CHECK_WHEELS := $(VPY) tests/packaging/check_wheels.py

test: setup
	$(VPY) -m pytest $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-tiers
	$(BUILD_WHEELS)
	$(CHECK_WHEELS)

test-tiers: setup
	FREETOKEN_CPU_MOE_ISA=avx2 $(VPY) -m pytest -q $(CPU_BACKEND_TESTS)
	FREETOKEN_CPU_MOE_ISA=scalar $(VPY) -m pytest -q $(KERNEL_TESTS)

run: setup
	$(VENV)/bin/freetoken serve

setup: toolchain install

$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(VPY)

# The ROCm compiler from Debian (HIP 5.2) so freetoken-rocm compiles for gfx1030.
toolchain:
	@if ! command -v hipcc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian's ROCm compiler (hipcc)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc libamdhip64-dev rocm-device-libs >/dev/null; \
	  else echo "warning: hipcc missing and not root: freetoken-rocm builds without its HIP extension"; fi; \
	fi

install: $(VPY)
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps --no-build-isolation $(PKGS)
	$(PIP) install -q --no-deps --no-build-isolation -e .

# The wheels are built with .venv's build tools and freetoken-core: set it up first if needed.
wheels:
	@$(VPY) -c 'import freetoken, pybind11, setuptools' 2>/dev/null || $(MAKE) --no-print-directory setup
	$(BUILD_WHEELS)

wheel-check: wheels
	$(CHECK_WHEELS)

clean:
	rm -rf $(VENV) build dist */build */src/*.egg-info *.egg-info
	find . -name '*.so' -path '*/src/*' -delete
