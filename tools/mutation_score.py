"""The mutation score per module, from mutmut 3's results in mutants/ (after `make mutate`).

    python tools/mutation_score.py [MODULE]

One row per mutated module (or only MODULE, a path like ddp_cli/io.py): mutants, killed (a test failed,
or timed out), survived, others (not checked, no tests, suspicious), and the score killed / (killed +
survived + no tests). Mutants judged equivalent are listed in tests/mutation-survivors.md; the score
there leaves them out. Then the surviving mutants' names, for `mutmut show NAME`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

MUTANTS = Path("mutants")
KILLED = {1, 3, 36, 24, -24, 152, 255}  # a failing test (3: pytest's internal error), or a timeout
SURVIVED, NO_TESTS = 0, {5, 33}


def verdicts(meta: Path) -> dict[str, int | None]:
    return json.loads(meta.read_text())["exit_code_by_key"]


def main(only: str = "") -> int:
    metas = sorted(MUTANTS.glob("ddp_cli/**/*.py.meta"))
    if not metas:
        print("no results in mutants/: run `make mutate` first")
        return 1
    columns = ("mutants", "killed", "survived", "no tests", "other", "score")
    print(f"{'module':40}", *(f"{c:>8}" for c in columns))
    survivors = []
    for meta in metas:
        module = str(meta.relative_to(MUTANTS)).removesuffix(".meta")
        if only and module != only:
            continue
        codes = verdicts(meta)
        counts = Counter("killed" if c in KILLED else "survived" if c == SURVIVED
                         else "no tests" if c in NO_TESTS else "other" for c in codes.values())
        survivors += [name for name, c in codes.items() if c == SURVIVED]
        tested = counts["killed"] + counts["survived"] + counts["no tests"]
        score = f"{counts['killed'] / tested:.1%}" if tested else "-"
        row = (len(codes), counts["killed"], counts["survived"], counts["no tests"], counts["other"], score)
        print(f"{module:40}", *(f"{v:>8}" for v in row))
    if survivors:
        print("\nsurvived (mutmut show NAME):", *sorted(survivors), sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
