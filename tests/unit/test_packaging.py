"""pyproject.toml, the Makefile and constraints.txt agree with each other and with the code."""

from __future__ import annotations

import tomllib

from conftest import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ddp_cli.errors import ALSO_IN, DISTRIBUTION, EXTRAS

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
OPTIONAL = PROJECT["optional-dependencies"]
TEST_GROUP = PYPROJECT["dependency-groups"]["test"]
DOCS_GROUP = PYPROJECT["dependency-groups"]["docs"]


def names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_the_extras_the_errors_name_are_the_ones_published():
    assert PROJECT["name"] == DISTRIBUTION
    assert set(OPTIONAL) == {*EXTRAS, "all"}
    for extra, (_, package) in EXTRAS.items():
        besides = {canonicalize_name(p) for _, p in ALSO_IN.get(extra, ())}
        assert names(OPTIONAL[extra]) == {canonicalize_name(package), *besides}, extra
    (everything,) = (Requirement(r) for r in OPTIONAL["all"])
    assert everything.name == DISTRIBUTION and everything.extras == set(EXTRAS)


def test_the_core_install_leaves_every_extra_out():
    assert not names(PROJECT["dependencies"]) & {canonicalize_name(p) for _, p in EXTRAS.values()}


def test_the_test_group_holds_the_dev_tools_and_every_extra_as_published():
    assert {"pytest", "pytest-timeout", "moto", "ruff"} <= names(TEST_GROUP)
    assert "server" in next(Requirement(r) for r in TEST_GROUP if r.startswith("moto")).extras
    for extra in EXTRAS:
        assert set(OPTIONAL[extra]) <= set(TEST_GROUP), extra  # the same requirement, not a drifted twin


def test_pep_639_license_with_a_setuptools_that_reads_it():
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the ddp authors" in text
    (backend,) = (Requirement(r) for r in PYPROJECT["build-system"]["requires"])
    assert backend.name == "setuptools" and not backend.specifier.contains("76.3")


def test_constraints_pin_every_requirement_and_torch_with_its_torchvision():
    lines = (REPO / "constraints.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    pins = {canonicalize_name(name): version for name, version in pins.items()}
    assert (pins["torch"], pins["torchvision"]) == ("2.14.1", "0.29.1")
    assert DISTRIBUTION not in pins
    extras = [r for extra in EXTRAS for r in OPTIONAL[extra]]
    for line in PROJECT["dependencies"] + extras + TEST_GROUP + DOCS_GROUP:
        requirement = Requirement(line)
        assert requirement.specifier.contains(pins[canonicalize_name(requirement.name)]), line


def test_make_setup_installs_core_extras_and_both_groups_at_the_pinned_versions():
    makefile = (REPO / "Makefile").read_text()
    assert "pip install -q -c constraints.txt -e '.[all]' --group test --group docs" in makefile
    assert "'pip>=25.1'" in makefile  # the first pip to read dependency groups
    assert {"mkdocs", "mkdocs-material"} <= names(DOCS_GROUP)


def test_make_test_builds_the_docs_strict_before_the_tests():
    makefile = (REPO / "Makefile").read_text()
    assert "mkdocs build --strict" in makefile
    recipe = makefile.split("\ntest: setup\n", 1)[1].split("\n\n", 1)[0].splitlines()
    first_pytest = next(i for i, line in enumerate(recipe) if "pytest" in line)
    assert any("$(MKDOCS)" in line for line in recipe[:first_pytest])
