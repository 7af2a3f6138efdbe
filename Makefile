# The README's two commands are `make demo` and `make test`; each sets up .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mpx-installed
BENCH_STAMP := $(VENV)/.bench-installed
APPS := .venv-apps
APPS_STAMP := $(APPS)/.mpx-installed

.PHONY: demo test test-summary apps-env check-export check-clean nbtest pytest apptest bench docs compat clean
# `make -n ...` (a dry run): the set-ups and `make test`'s summary only say what they would do
DRY := $(findstring n,$(firstword -$(MAKEFLAGS)))
LOGS := $(VENV)/test-logs

# $(call setup,STAMP,DIR,HOW LONG,DONE): make STAMP with pip's output in DIR/setup.log, said in a line and DONE after it (the
# log's end if it fails)
setup = $(if $(DRY),@echo "set up $(2) if $(1) is out of date", \
  @$(MAKE) -q $(1) 2>/dev/null || { echo "setting up $(2) ($(3); pip's output: $(2)/setup.log)"; mkdir -p $(2) && \
  $(MAKE) --no-print-directory $(1) > $(2)/setup.log 2>&1 || \
  { tail -n 40 $(2)/setup.log; echo "the set-up of $(2) failed: $(2)/setup.log"; exit 1; }; echo "$(4)"; })
VENV_DONE := $(VENV) is set up (torch's CPU wheel). fastai.vision does not import there (RuntimeError: operator torchvision::nms \
  does not exist): 'make apps-env' sets up $(APPS), where it does.
APPS_DONE := $(APPS) is set up: torch 2.14.1 with torchvision 0.29.1. Run scripts on fastai.vision or Hugging Face with $(APPS)/bin/python.

$(STAMP): settings.ini setup.py pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,fp8]'
	touch $@

# The first run sets up .venv, with pip's output in .venv/setup.log (shown if the set-up fails), so that the demo's
# output, piped to a file or not, is the demo's: the advice, a line per epoch, the table.
# The demo's own options go in ARGS: `make demo ARGS='--arch cnn --epochs 4'` (make takes no --options of its own here).
demo:
	$(call setup,$(STAMP),$(VENV),a few minutes,$(VENV_DONE))
	@$(BIN)/python demo/digits.py $(ARGS)

# `make test` runs every step, whatever an earlier one gave, and ends with one summary: each step's outcome and time, what
# pytest skipped and why, what was not tested. pytest's and the apps' output also go to $(LOGS)/. The times are a 2-core
# machine's (an AMD EPYC, Zen 2): about 18 minutes from a fresh clone (.ci/run, measured), 15 once both environments are set up.
TEST_STEPS := check-export check-clean nbtest pytest apptest
test:
	@echo "make test: set-up of $(VENV) (first run only, ~2 min), then $(TEST_STEPS)"
	@echo "  (the notebooks' export and cleanliness, their tests ~1 min, pytest ~10 min, the set-up of $(APPS) on first use ~2 min"
	@echo "  and ~7 GB, tests/apps ~4 min): about 18 minutes on 2 cores, less on more; a summary at the end."
	$(call setup,$(STAMP),$(VENV),first run only: about 2 minutes,$(VENV_DONE))
	$(if $(DRY),$(MAKE) $(TEST_STEPS),@$(run_steps))

# Each step of `make test` in turn, its outcome and seconds in $(LOGS)/steps; then the summary; fails if a step failed
define run_steps
mkdir -p $(LOGS) && rm -f $(LOGS)/*.log $(LOGS)/steps && start=$$(date +%s); \
for step in $(TEST_STEPS); do echo; echo "== make $$step"; t0=$$(date +%s); $(MAKE) --no-print-directory $$step; \
  echo "$$step $$? $$(( $$(date +%s) - t0 ))" >> $(LOGS)/steps; done; \
$(MAKE) --no-print-directory test-summary SECONDS_TOTAL=$$(( $$(date +%s) - start )); \
! grep -qv ' 0 [0-9]*$$' $(LOGS)/steps
endef

# The summary `make test` ends with (run alone, it summarises the last run's $(LOGS))
test-summary:
	@echo; echo "== make test: summary ($$(( $(or $(SECONDS_TOTAL),0) / 60 )) min $$(( $(or $(SECONDS_TOTAL),0) % 60 )) s)"
	@while read step rc secs; do \
	  counts=$$( [ -f $(LOGS)/$$step.log ] && grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' $(LOGS)/$$step.log | tail -n 1 | \
	    sed -E 's/^=+ //; s/ in [0-9.]+s.*//'); \
	  printf '  %-13s %-7s %5ss%s\n' $$step $$( [ $$rc = 0 ] && echo passed || echo FAILED ) $$secs "$${counts:+  $$counts}"; \
	done < $(LOGS)/steps
	@for step in pytest apptest; do grep -E '^ *[0-9]+ (skipped|xfail): ' $(LOGS)/$$step.log 2>/dev/null | \
	  sed -E "s/^ *([0-9]+) (skipped|xfail): +/    $$step: \1 \2: /"; done | head -n 20 | \
	  { IFS= read -r first && { echo "  not checked, and why (tests/conftest.py counts them by reason):"; echo "$$first"; cat; }; } || true
	@grep -h '^NOT TESTED' $(LOGS)/*.log 2>/dev/null | sed 's/^/  /' || true
	@echo "  notebook cells flagged cuda (settings' tst_flags) run only with a GPU: nbdev-test --flags cuda"
	@failed=$$(awk '$$2 != 0 {print $$1}' $(LOGS)/steps | xargs); \
	echo "  logs: $(LOGS)/ (pytest's and the apps')"; \
	if [ -n "$$failed" ]; then echo "  FAILED: $$failed (its output is above)"; else echo "  every step passed"; fi

# Fails when the notebooks export something other than what is in mpx/ (export, then commit both).
# nbdev-export rewrites pyproject.toml; an unchanged one gets its time back, so .venv is not set up again after it.
check-export: $(STAMP)
	@tmp=$$(mktemp -d) && cp -r mpx $$tmp/ && cp -p pyproject.toml $$tmp/ && $(BIN)/nbdev-export && \
	{ cmp -s pyproject.toml $$tmp/pyproject.toml && touch -r $$tmp/pyproject.toml pyproject.toml; true; } && \
	if diff -r -x __pycache__ $$tmp/mpx mpx; then rm -rf $$tmp; \
	else rm -rf $$tmp; echo "mpx/ was stale: nbdev-export changed it; commit the exported modules"; exit 1; fi

# Fails when a notebook is not clean (run nbdev-clean, then commit).
check-clean: $(STAMP)
	@tmp=$$(mktemp -d) && cp -r nbs $$tmp/ && $(BIN)/nbdev-clean && \
	if diff -r $$tmp/nbs nbs >/dev/null; then rm -rf $$tmp; \
	else rm -rf $$tmp; echo "nbs/ was not clean: nbdev-clean changed it; commit the cleaned notebooks"; exit 1; fi

# The pages' temporary folders (a save, a checkpoint) in one that goes after the run; inductor's cache stays where it was
nbtest: $(STAMP)
	@tmp=$$(mktemp -d) && export TORCHINDUCTOR_CACHE_DIR=$${TORCHINDUCTOR_CACHE_DIR:-$${TMPDIR:-/tmp}/torchinductor_$$(id -un)} && \
	TMPDIR=$$tmp $(BIN)/nbdev-test --timing; rc=$$?; rm -rf $$tmp; exit $$rc

# tests/test_docs.py checks the site in Chromium and skips those tests where it is missing: say so last, whatever pytest's
# outcome, so that a run without it does not read as a full pass. .ci/run installs it.
CHROMIUM ?= $(or $(MPX_CHROMIUM),/usr/bin/chromium)
# A worker on each core, a test file each (the cases of a file share their fixtures and files); XDIST= runs in one process
XDIST ?= -n 2 --dist loadfile
# the apps' cases by group (tests/apps/test_vision.py: an architecture's on one worker, its fp32 runs made once), the others
# spread: the vision file alone would keep one worker busy while the other finished Hugging Face's
APPS_XDIST ?= $(if $(XDIST),-n 2 --dist loadgroup,)
pytest: $(STAMP)
	@mkdir -p $(LOGS); MPX_CHROMIUM=$(CHROMIUM) $(BIN)/python -m pytest -ra $(XDIST) tests --ignore=tests/apps 2>&1 | \
	  tee $(LOGS)/pytest.log; rc=$${PIPESTATUS[0]}; \
	if [ ! -x "$(CHROMIUM)" ]; then echo; \
	  echo "NOT TESTED: the docs site in a browser (tests/test_docs.py's browser tests were skipped): $(CHROMIUM) is missing." | \
	    tee -a $(LOGS)/pytest.log; \
	  echo "  Install Chromium (Debian/Ubuntu: sudo apt-get install chromium, as .ci/run does) and run make test again."; fi; \
	exit $$rc

# bench/step.py's optimi arm: torch-optimi's only dependency is torch, which --no-deps keeps at the pinned CPU wheel.
$(BENCH_STAMP): $(STAMP) constraints.txt
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt torch-optimi
	touch $@

# fastai's applications where users train (tests/apps: vision_learner on a resnet and an xresnet, Hugging Face's GPT-2
# and a BERT classifier) on the apps' stack, a second environment: constraints-apps.txt's torch 2.14.1 + torchvision
# 0.29.1 (PyPI's torchvision does not import beside the CPU wheel 2.13.0) over constraints.txt's other pins. About two
# minutes to set up, from this workplace's disk; DESIGN.md (Two stacks) says why not the whole project.
$(APPS_STAMP): settings.ini setup.py pyproject.toml constraints.txt constraints-apps.txt
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); [ -x $(APPS)/bin/python ] || [ $$free -ge 8 ] || \
	  { echo "$(APPS) needs ~7 GB of disk (torch's CUDA build and its nvidia packages): $$free GB free here"; exit 1; }
	test -x $(APPS)/bin/python || $(PYTHON) -m venv $(APPS)
	$(APPS)/bin/python -m pip install -q --upgrade pip
	$(APPS)/bin/python -m pip install -q -c constraints-apps.txt -c <(grep -vE '^torch(vision)?==' constraints.txt) \
	  -e . torchvision transformers pytest pytest-xdist hypothesis psutil
	touch $@

apptest:
	$(call setup,$(APPS_STAMP),$(APPS),first use only: about 3 minutes and ~7 GB of disk,$(APPS_DONE))
	@mkdir -p $(LOGS); $(APPS)/bin/python -m pytest -ra $(APPS_XDIST) tests/apps 2>&1 | tee $(LOGS)/apptest.log; exit $${PIPESTATUS[0]}

# The apps' stack alone, for scripts of your own on fastai.vision or Hugging Face: in .venv torchvision does not import
apps-env:
	$(call setup,$(APPS_STAMP),$(APPS),about 3 minutes and ~7 GB of disk,$(APPS_DONE))

# bench/apps.py (vision, Hugging Face) runs on the apps' stack; the rest on .venv
bench: $(BENCH_STAMP) $(APPS_STAMP)
	@for f in bench/[!_]*.py; do [ $$f = bench/apps.py ] && continue; echo "== $$f"; $(BIN)/python $$f || exit 1; done
	@echo "== bench/apps.py"; $(APPS)/bin/python bench/apps.py

# The docs site from the notebooks into _docs/ (nbdev's processing, then Sphinx + MyST-NB), and README.md from
# nbs/index.ipynb. Not part of `make test`, whose tests/test_docs.py builds the site itself when it is stale.
docs: $(STAMP)
	$(BIN)/python docs/adapt.py

# mpx on the oldest versions settings.ini declares (constraints-min.txt's pins), in $(COMPAT): the notebooks' tests under
# nbdev 2 (nbdev 3 needs fastcore 2.2), then tests/smoke.py --full (every mode, fused setting and opt_state fits once).
# Not part of `make test`: torch from the registry is a CUDA build, ~0.8 GB and ~3 GB of nvidia runtime packages (it runs
# on a CPU). Skipped notebooks, each for a reason that is not mpx's floor: 05a_fp8 and 99_test_utils (its fp8 cells) need
# the fp8 extra, and torchao 0.18 does not import on torch 2.7; 08_progress's test drives fastprogress 1.1's
# MasterBar.progress, and fastcore 1.8 gets fastprogress 1.0.5 (QuietProgress itself runs there: the smoke's fits use it).
# bench/HISTORY.md (Compatibility) records what it ran and how long it took.
COMPAT := .venv-compat
COMPAT_SKIP := ^(_|\.|05a_fp8|08_progress|99_test_utils)
$(COMPAT)/.installed: constraints-min.txt settings.ini setup.py
	test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install -q -c constraints-min.txt -e '.[fsdp]' nbdev pytest hypothesis scikit-learn matplotlib psutil
	touch $@

compat: $(COMPAT)/.installed
	@$(COMPAT)/bin/python -c "import torch, fastai, fastcore, fastprogress, accelerate as a; \
	  print('compat:', *(f'{m.__name__} {m.__version__}' for m in (torch, fastai, fastcore, fastprogress, a)))"
	time $(COMPAT)/bin/nbdev_test --timing --n_workers 1 --skip_file_re '$(COMPAT_SKIP)'
	cd $$(mktemp -d) && time $(CURDIR)/$(COMPAT)/bin/python $(CURDIR)/tests/smoke.py --full

clean:
	rm -rf $(VENV) $(COMPAT) $(APPS) _proc _docs .pytest_cache *.egg-info
