"""Every parser and reader of user files, fed mutants of a valid file (`targets.TARGETS`), and every
failure ever found (`corpus/<target>/<case>`) replayed as a named regression case."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from fuzz_targets import BY_NAME, TARGETS, Target
from fuzzing import budget, user_error_or_none
from hypothesis import given
from hypothesis import strategies as st
from mutants import mutants

CORPUS = Path(__file__).parent / "corpus"
EXAMPLES = 60  # per target in `make test`


def write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def check(target: Target, mutant: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write(root, {**target.files(), target.mutated: mutant})
        user_error_or_none(lambda: target.read(root), target.named)


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_the_valid_file_reads(target: Target):
    """The seed itself reads: the mutants start from a file the reader takes."""
    check(target, target.files()[target.mutated])


@pytest.mark.parametrize("target", TARGETS, ids=str)
@budget(EXAMPLES)
@given(data=st.data())
def test_mutant(target: Target, data: st.DataObject):
    check(target, data.draw(mutants(target.files()[target.mutated]), label=target.mutated))


CASES = sorted(CORPUS.glob("*/*"))


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus(case: Path):
    """A mutant that once ended in an internal error (its file name says what it was)."""
    check(BY_NAME[case.parent.name], case.read_bytes())
