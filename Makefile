# The course's two commands (see README.md):
#   make course   create .venv, install, execute every notebook into build/ and write build/report.md
#   make test     create .venv, install, run the test suite
# Options: `make course PROFILE=cpu` (smoke, cpu or gpu); `make test PROFILE=cpu` or `COURSE_TEST_PROFILE=cpu make test`
# runs the notebook tests at that profile (the environment reaches every command below);
# `make lab LAB_ARGS="--port 8890 --no-browser"` passes LAB_ARGS on to JupyterLab.
# On a machine without a GPU (a CPU-only CI runner), `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`
# installs PyTorch's CPU build of the same pinned version (2.14.1+cpu satisfies ==2.14.1): about 200 MB instead of
# the default wheel's CUDA libraries (several GB; their download and install were most of the install's 2 minutes).
PYTHON ?= python3
VENV ?= .venv
PROFILE ?=
TORCH_INDEX ?=
LAB_ARGS ?=
BIN := $(VENV)/bin

$(BIN)/course: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),) -e '.[test]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(BIN)/course

install: $(BIN)/course

course: install
	$(BIN)/course run $(if $(PROFILE),--profile $(PROFILE),)

test: install
	$(if $(PROFILE),COURSE_TEST_PROFILE=$(PROFILE) ,)$(BIN)/python -m pytest

# JupyterLab on the course folder; `course lab` adds --allow-root when run as root (Jupyter refuses root without it)
lab: install
	$(BIN)/course lab $(LAB_ARGS)

.PHONY: install course test lab
