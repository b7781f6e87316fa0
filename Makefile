# FreeToken developer entry points.
#   make test   set up everything on a fresh machine (venv, torch, all packages, native
#               builds, the ROCm compiler when root) and run the test suite
#   make run    set up, then serve the built-in demo model on http://127.0.0.1:8000
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
# Our packages: installed from their paths, editable, never from an index.
PKGS := -e ./freetoken-core -e ./freetoken-cpu-moe -e ./freetoken-cuda -e ./freetoken-rocm -e ./tests/plugins/freetoken-fakegpu
PYTEST_ARGS ?=

.PHONY: test run setup venv toolchain install clean

test: setup
	$(VPY) -m pytest $(PYTEST_ARGS)

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

clean:
	rm -rf $(VENV) build */build */src/*.egg-info
	find . -name '*.so' -path '*/src/*' -delete
