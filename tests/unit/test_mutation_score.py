"""tools/mutation_score.py (the end of `make mutate`) on fake mutmut results: the verdicts read from the
survivors list's tables, the counts and score per module, and exit 1 on a survivor without a row."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mutation_score", REPO / "tools" / "mutation_score.py")
ms = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ms)

LIST = """# Survivors

Prose naming `x_a__mutmut_1` is not a row.

## Scope

## ddp_cli/io.py

| mutant | change | verdict | why |
|---|---|---|---|
| `x_a__mutmut_1` | a default | equivalent | the same |
| `xǁCǁb__mutmut_2` | a device | accepted | only on CUDA |
| `x_a__mutmut_5` | since killed | equivalent | stale |

## ddp_cli/train/mixing.py

No survivors.
"""


@pytest.fixture
def results(tmp_path: Path, monkeypatch) -> Path:
    """io.py: 6 mutants, 2 killed (a failing test, a timeout), 4 survived (one reached by no test) of which
    one has no row; mixing.py: one killed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "mutation-survivors.md").write_text(LIST)
    codes = {"ddp_cli.io.x_a__mutmut_1": 0, "ddp_cli.io.xǁCǁb__mutmut_2": 33, "ddp_cli.io.x_a__mutmut_3": 0,
             "ddp_cli.io.x_a__mutmut_4": 1, "ddp_cli.io.x_a__mutmut_5": 24, "ddp_cli.io.x_a__mutmut_9": 0}
    for module, by_key in (("io.py", codes), ("train/mixing.py", {"ddp_cli.train.mixing.x_p__mutmut_1": 1})):
        meta = tmp_path / "mutants" / "ddp_cli" / f"{module}.meta"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"exit_code_by_key": by_key}))
    return tmp_path


def test_verdicts_are_the_rows_of_each_modules_table():
    assert ms.verdicts(LIST) == {"ddp_cli.io.x_a__mutmut_1": "equivalent",
                                 "ddp_cli.io.xǁCǁb__mutmut_2": "accepted",
                                 "ddp_cli.io.x_a__mutmut_5": "equivalent"}


@pytest.mark.parametrize("text", ["## ddp_cli/io.py\n\n| `x_a__mutmut_1` | a default | to do | later |\n",
                                  "## Scope\n\n| `x_a__mutmut_1` | a default | equivalent | the same |\n"],
                         ids=["another-verdict", "outside-a-module"])
def test_a_row_that_would_not_count_is_refused_with_its_line(text):
    with pytest.raises(ValueError, match=r"mutation-survivors.md:3: .*equivalent or accepted"):
        ms.verdicts(text)


def test_counts_score_unclassified_and_stale_rows(results, capsys):
    assert ms.main() == 1
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("ddp_cli/")}
    # mutants, killed, survived, equivalent, accepted, unclassified, killed / (mutants - equivalent)
    assert rows["ddp_cli/io.py"] == ["6", "2", "4", "1", "1", "2", "40.0%"]
    assert rows["ddp_cli/train/mixing.py"] == ["1", "1", "0", "0", "0", "0", "100.0%"]
    unclassified = out.split("unclassified survivors")[1].split("stale rows")[0]
    assert "ddp_cli.io.x_a__mutmut_3" in unclassified and "ddp_cli.io.x_a__mutmut_9" in unclassified
    assert "mutmut_1\n" not in unclassified
    assert out.split("stale rows")[1].split("\n")[1].strip() == "ddp_cli.io.x_a__mutmut_5"


def test_every_survivor_with_a_row_passes(results, capsys):
    assert ms.main("ddp_cli/train/mixing.py") == 0
    assert "unclassified survivors" not in capsys.readouterr().out
