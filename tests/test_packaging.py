"""The pip and conda environments pin the same versions; the console script is declared."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pyproject_pins() -> dict[str, str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = meta["dependencies"] + [r for extra in meta["optional-dependencies"].values() for r in extra]
    return dict(r.split("==") for r in reqs)


def _conda_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"\s*-\s*([A-Za-z0-9_.\-]+)==([^\s#]+)", line)
        if m:
            pins[m[1]] = m[2]
    return pins


def test_every_dependency_is_pinned_exactly():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for req in meta["dependencies"]:
        assert "==" in req, f"{req} is not pinned"


def test_pip_and_conda_pins_agree():
    assert _pyproject_pins() == _conda_pins()


def test_ci_pins_torch():
    pins = _pyproject_pins()
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"


def test_console_script():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["scripts"]["course"] == "course_lib.tools.cli:main"
