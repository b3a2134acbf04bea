# The course's two commands (see README.md):
#   make course   create .venv, install, execute every notebook into build/ and write build/report.md
#   make test     create .venv, install, run the test suite
PYTHON ?= python3
VENV ?= .venv
PROFILE ?=
BIN := $(VENV)/bin

$(BIN)/course: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(BIN)/course

install: $(BIN)/course

course: install
	$(BIN)/course run $(if $(PROFILE),--profile $(PROFILE),)

test: install
	$(BIN)/python -m pytest

lab: install
	$(BIN)/jupyter lab notebooks/

.PHONY: install course test lab
