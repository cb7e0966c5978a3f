# The handful of commands a newcomer needs. Each target creates/reuses .venv and
# installs everything pdx needs on a machine that only has Python 3.11: exactly the versions
# locked in requirements/dev.txt (with hashes), by uv, which pip installs first from
# requirements/bootstrap.txt. `make lock` refreshes the locks (see README "Development").
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.pdx-installed
LOCK   := requirements/dev.txt
UV     := $(BIN)/uv
# uv reads no pip configuration: where pip finds wheels (this machine keeps the CPU torch in a
# find-links folder), uv is told too.
UV_SYNC = $(UV) pip sync --quiet --require-hashes --python $(BIN)/python \
	$(foreach d,$(shell PYTHON=$(PYTHON) scripts/pip-find-links),--find-links $(d))

.PHONY: install sync lock lock-check lower-bounds demo test lint typecheck unit proto proto-check \
	system-tools vllm vllm-if-possible bench clean image

$(UV): requirements/bootstrap.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --require-hashes \
	  -r requirements/bootstrap.txt
	touch $(UV)

$(STAMP): $(UV) $(LOCK) pyproject.toml
	$(UV_SYNC) $(LOCK)
	$(UV) pip install --quiet --no-deps --python $(BIN)/python -e .
	touch $(STAMP)

install: $(STAMP)

# Put .venv back to exactly the lock (after a hand install, or to drop stray packages).
sync: $(UV)
	rm -f $(STAMP)
	$(MAKE) --no-print-directory install

# Refresh requirements/*.txt from pyproject.toml and requirements/*.in; UPGRADE=1 takes the
# newest allowed versions (otherwise a pin that is still allowed stays).
lock: $(UV)
	UV=$(UV) UPGRADE=$(UPGRADE) PYTHON=$(PYTHON) scripts/lock.sh

# pyproject.toml's lower bounds: the lowest allowed set installs, imports and runs `pdx --help`.
lower-bounds: $(UV)
	UV=$(UV) PYTHON=$(PYTHON) scripts/lower-bounds.sh

# Fails when .venv differs from the lock, or the lock from pyproject.toml's ranges.
lock-check: $(STAMP)
	$(BIN)/python scripts/check_lock.py $(LOCK) --pyproject pyproject.toml --extra dev

# The main job on the embedded default: the smoke acceptance playbook (deploy, load, a KV link
# break, verdict); the report lands in reports/. NO-GO (exit 1) and INCONCLUSIVE (exit 3) are
# verdicts, not failures of the demo; only "could not run" (exit 2) fails it.
demo: $(STAMP)
	$(BIN)/pdx accept playbooks/smoke.yaml || { rc=$$?; [ $$rc -eq 1 ] || [ $$rc -eq 3 ]; }

lint: $(STAMP)
	$(BIN)/ruff check pdx tests benchmarks loadtests
	$(BIN)/ruff format --check pdx tests benchmarks loadtests

typecheck: $(STAMP)
	$(BIN)/mypy

# Two passes: every test not marked `alone` on TEST_WORKERS workers (a module's tests on one
# worker, the network-namespace tests one after the other), then the `alone` ones (they judge
# time, rate or capacity measured while they run) one at a time with the machine to themselves.
# Both passes run whatever the first found; the target fails if either did.
TEST_WORKERS ?= 2
unit: $(STAMP) system-tools vllm-if-possible
	rc=0; \
	$(BIN)/python -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadgroup \
	  -m "not alone" || rc=$$?; \
	$(BIN)/python -m pytest -q -ra --durations=15 -m alone || rc=$$?; \
	exit $$rc

# The vLLM environment (engine: vllm) in its own venv, .venv-vllm; pdx's .venv is not touched.
# `make vllm` fails when it cannot build; `make test` builds it when the machine can (Linux
# x86_64 with AVX2, Python 3.11, 5 GB disk, 8 GiB memory) and otherwise prints why, and the
# vLLM tests skip with that reason. PDX_NO_VLLM=1 never builds it.
vllm:
	@PYTHON=$(PYTHON) scripts/vllm-env.sh

vllm-if-possible:
	@PYTHON=$(PYTHON) scripts/vllm-env.sh --if-possible

# Debian tools for system tests (netns, nft, ping, chromium); root only, PDX_NO_APT=1 skips.
system-tools:
	@scripts/ensure-system-tools.sh

test: lock-check proto-check lint typecheck unit

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

# Regenerate into a temporary directory and fail if pdx/_proto differs from it.
proto-check: $(STAMP)
	tmp=$$(mktemp -d) && $(BIN)/python scripts/gen_proto.py --out $$tmp/_proto >/dev/null \
	  && diff -r -x __pycache__ $$tmp/_proto pdx/_proto; rc=$$?; rm -rf $$tmp; exit $$rc

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

# The container image (Containerfile) with no registry and no network beyond the package sources:
# a wheelhouse from pip's configured sources, a Debian base made with mmdebstrap (or BASE_IMAGE),
# then docker, podman or buildah, whichever runs here. IMAGE_TARGET=vllm adds the vLLM
# environment. See docs/deploy.md "Container image".
IMAGE_TARGET ?= runtime
image:
	@PYTHON="$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))" \
	  scripts/build-image.sh --target $(IMAGE_TARGET)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
