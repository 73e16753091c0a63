# The two front-door commands: `make test` and `make demo`. Both build .venv from scratch if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --constraint constraints-cpu.txt

.PHONY: test demo docs bench soak check-protocol clean

$(VENV)/.installed-test: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[test]'
	touch $@

$(VENV)/.installed-docs: $(VENV)/.installed-test
	$(PIP) -e '.[docs]'
	touch $@

$(VENV)/.installed-demo: $(VENV)/.installed-test
	$(PIP) -e '.[test,demo,hf,accelerate,lightning,trl,tensorboard,audio,ray]'
	touch $@

# Two pytest-xdist workers, a test file each at a time (a file's tests share its module-level worlds): the
# suite is CPU-bound, and on 2 cores this takes it from ~24 to ~15 min.
# The docs extra too: tests/test_docs.py builds the site once and checks what a reader sees.
test: $(VENV)/.installed-demo $(VENV)/.installed-docs
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=10

demo: $(VENV)/.installed-demo
	$(VENV)/bin/evenflow demo

# The documentation site from docs/ and the docstrings; --strict fails on any warning (a broken link, a missing
# include, a docstring reference that does not resolve). `$(VENV)/bin/mkdocs serve` to browse it.
docs: $(VENV)/.installed-docs
	$(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(VENV)/.installed-demo
	$(PIP) -e '.[bench]'
	$(PY) benchmarks/run_all.py

# Randomized soak of the loader's guarantees (issue 10): >= 1,000 pooled + >= 100 fresh-process
# configurations on real gloo worlds; prints one JSON line last (lost, duplicated, hangs, ...). Then the
# W -> W' resume sweep (issue 20): every ordered pair of world sizes in 1..4, both policies, accumulation 1/2,
# join and quota; its own JSON line.
soak: $(VENV)/.installed-test
	$(PY) benchmarks/failures/soak.py --seed 0 --configs 1000 --fresh 100 --time-limit 1800
	$(PY) benchmarks/failures/soak.py --elastic --seed 0

check-protocol: $(VENV)/.installed-test
	$(PY) -m pytest -q tests/test_model_checker.py

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info
