# hetfl: `make demo` and `make test` do the whole set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hetfl-installed
DATA   ?= data
# pytest-xdist workers for `make test` (each gives torch one thread; 0 runs the suite in one process)
TEST_WORKERS ?= 2

.PHONY: install data demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,flower,ray]'
	touch $(STAMP)

install: $(STAMP)

data: install
	$(BIN)/hetfl data fetch mnist fmnist --root $(DATA)

demo: data
	$(BIN)/hetfl run configs/demo-mnist.yaml --data-root $(DATA) --out runs/demo-mnist

lint: install
	$(BIN)/ruff check src tests examples

test: data lint
	$(BIN)/pytest -q -n $(TEST_WORKERS) --durations=15

clean:
	rm -rf runs cache .pytest_cache
