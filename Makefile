# adaattn developer entry points; everything works from a fresh clone.
#
#   make demo    venv + pinned deps, build the extension, run examples/quickstart.py
#   make test    same setup/build, then pytest, the CMake/Catch2 C++ tests (ctest) with the
#                installed CMake package's example (examples/cpp), and the wheel check
#   make wheel-check   pip wheel (reusing the build's objects), then tools/check_wheel.py
#
# Knobs: MAX_JOBS (parallel compile jobs, default 2), ADAATTN_CUDA / ADAATTN_CUDA_ARCHS (see
# setup.py), PYTHON (interpreter that creates .venv, default python3).
# Each step leaves a stamp under build/stamps, so re-running only redoes what changed.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
MAX_JOBS ?= 2
export MAX_JOBS

VENV := .venv
PY := $(VENV)/bin/python
STAMPS := build/stamps
CMAKE_DIR := build/cmake
CMAKE_INSTALL := $(abspath build/install)
EXAMPLE_DIR := build/example
WHEEL_DIR := build/dist

# ccache (installed by the system step) for the setup.py build: the g++ wrapper for C++ (torch
# accepts it as g++), and PYTORCH_NVCC, which torch's ninja build uses as the nvcc command.
CCACHE_ENV = $(if $(wildcard /usr/lib/ccache/g++),CXX=/usr/lib/ccache/g++) \
             $(if $(and $(wildcard /usr/bin/ccache),$(NVCC)),PYTORCH_NVCC="ccache $(NVCC)")
NVCC := $(or $(shell command -v nvcc 2>/dev/null),$(wildcard $(or $(CUDA_HOME),/usr/local/cuda)/bin/nvcc))

SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

# Prints the wall time of a phase: $(call timed,name,command)
timed = start=$$(date +%s); $(2); echo "[make] $(1): $$(( $$(date +%s) - start ))s"

EXT_INPUTS := setup.py pyproject.toml $(shell find csrc -type f 2>/dev/null)
# Rebuild when the library is missing even if the stamp is newer than the sources.
EXT_MISSING := $(if $(wildcard adaattn/_C*.so),,FORCE)

.PHONY: demo test pytest ctest wheel-check setup build clean FORCE

demo: build
	$(PY) examples/quickstart.py

test: pytest ctest wheel-check

setup: $(STAMPS)/system $(STAMPS)/venv

build: $(STAMPS)/ext

pytest: build
	@$(call timed,pytest,$(PY) -m pytest -q tests)

# After the tests: install the CMake package and build and run examples/cpp against the install
# (a separate CMake project doing find_package(adaattn)). Its commands are separated by ";" so
# that -e stops at any failure (an "a && b" list does not).
ctest: $(STAMPS)/cmake-configure
	@$(call timed,cmake build,cmake --build $(CMAKE_DIR) -j $(MAX_JOBS))
	@$(call timed,ctest,ctest --test-dir $(CMAKE_DIR) --output-on-failure)
	@$(call timed,cmake install + examples/cpp, \
	  rm -rf $(CMAKE_INSTALL); cmake --install $(CMAKE_DIR) --prefix $(CMAKE_INSTALL) >/dev/null; \
	  cmake -S examples/cpp -B $(EXAMPLE_DIR) -G Ninja \
	    -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) -DCMAKE_BUILD_TYPE=Release \
	    -DCMAKE_PREFIX_PATH=$(CMAKE_INSTALL) \
	    $(if $(wildcard /usr/bin/ccache),-DCMAKE_CXX_COMPILER_LAUNCHER=ccache) >/dev/null; \
	  cmake --build $(EXAMPLE_DIR); $(EXAMPLE_DIR)/train)

# The wheel from the objects the build step left in build/temp (setup.py): with the same
# compiler environment torch's ninja build finds them up to date and only links, so a CUDA build's
# wheel carries its CUDA kernels at no extra compile time. build/lib* is cleared first so that no
# stale module reaches the wheel.
wheel-check: build
	@rm -rf $(WHEEL_DIR) build/lib.*
	@$(call timed,wheel build, \
	  $(CCACHE_ENV) $(PY) -m pip wheel -q --no-build-isolation --no-deps -w $(WHEEL_DIR) .)
	@$(call timed,wheel check,$(PY) tools/check_wheel.py $(WHEEL_DIR)/adaattn-*.whl)

# System packages: Catch2 v2 (header-only, for tests/cpp), ccache, cmake.
$(STAMPS)/system:
	@if [ ! -f /usr/include/catch2/catch.hpp ] || ! command -v ccache >/dev/null \
	    || ! command -v cmake >/dev/null; then \
	  $(call timed,apt,$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    $(SUDO) apt-get install -y -qq --no-install-recommends catch2 ccache cmake >/dev/null); \
	fi
	@mkdir -p $(@D) && touch $@

$(STAMPS)/venv: requirements-dev.txt
	@$(call timed,venv + pip install, \
	  [ -x $(PY) ] || $(PYTHON) -m venv $(VENV); \
	  $(PY) -m pip install -q -r requirements-dev.txt)
	@mkdir -p $(@D) && touch $@

$(STAMPS)/ext: $(STAMPS)/system $(STAMPS)/venv $(EXT_INPUTS) $(EXT_MISSING)
	@$(call timed,extension build, \
	  $(CCACHE_ENV) $(PY) -m pip install -q --no-build-isolation --no-deps -e .)
	@mkdir -p $(@D) && touch $@

# CPU-only CMake build (ninja from the venv): the CUDA sources are compile-checked by the
# setup.py build above.
$(STAMPS)/cmake-configure: $(STAMPS)/system $(STAMPS)/venv CMakeLists.txt \
    cmake/adaattnConfig.cmake.in
	@$(call timed,cmake configure, \
	  cmake -S . -B $(CMAKE_DIR) -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) \
	    -DCMAKE_BUILD_TYPE=Release -DADAATTN_WITH_CUDA=OFF \
	    -DPython3_EXECUTABLE=$(abspath $(PY)) >/dev/null)
	@mkdir -p $(@D) && touch $@

clean:
	rm -rf build adaattn/_C*.so *.egg-info

FORCE:
