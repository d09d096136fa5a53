"""The mutation score per module, from mutmut 3's results in mutants/ and the verdicts in
tests/mutation-survivors.md (after `make mutate`).

    python tools/mutation_score.py [MODULE]

One row per mutated module (or only MODULE, a path like ddp_cli/io.py): mutants, killed (a test failed,
or timed out), survived (no test failed, or none reached it), of those the equivalent and accepted ones
(a row in the list's table for that module) and the unclassified rest, and the score killed / (mutants -
equivalent). Then the unclassified survivors' names (for `mutmut show NAME`), rows naming a mutant that
no longer survives (stale: delete them), and mutants not run. Exit 1 if any survivor is unclassified, so
that `make mutate` fails when a new mutant gets through: kill it with a test or give it a row.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

MUTANTS = Path("mutants")
SURVIVORS = Path("tests/mutation-survivors.md")
KILLED = {1, 3, 36, 24, -24, 152, 255}  # a failing test (3: pytest's internal error), or a timeout
SURVIVED = {0, 5, 33}  # no test failed; 5, 33: no test reached it
VERDICTS = ("equivalent", "accepted")
SECTION = re.compile(r"^## (ddp_cli/\S+\.py)")
ROW = re.compile(r"^\| `([^`]+)` \|")  # | `name` | change | verdict | why |  (no | inside a cell)


def verdicts(text: str) -> dict[str, str]:
    """Full mutant name -> verdict, from each `## module` section's table rows. A row outside a module's
    section, of another shape or with another verdict, is an error: it would count for nothing."""
    found, module = {}, None
    for number, line in enumerate(text.splitlines(), 1):
        if heading := SECTION.match(line):
            module = heading[1].removesuffix(".py").replace("/", ".")
        elif line.startswith("## "):
            module = None
        elif row := ROW.match(line):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if module is None or len(cells) != 4 or cells[2] not in VERDICTS:
                raise ValueError(f"{SURVIVORS}:{number}: a row needs a module's section, four cells and "
                                 f"a verdict of {' or '.join(VERDICTS)}: {line}")
            found[f"{module}.{row[1]}"] = cells[2]
    return found


def main(only: str = "") -> int:
    metas = sorted(MUTANTS.glob("ddp_cli/**/*.py.meta"))
    if not metas:
        print("no results in mutants/: run `make mutate` first")
        return 1
    listed = verdicts(SURVIVORS.read_text())
    columns = ("mutants", "killed", "survived", "equiv.", "accepted", "unclass.", "score")
    print(f"{'module':34}", *(f"{c:>8}" for c in columns))
    unclassified, stale, not_run = [], [], []
    for meta in metas:
        module = str(meta.relative_to(MUTANTS)).removesuffix(".meta")
        if only and module != only:
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        survivors = {name for name, code in codes.items() if code in SURVIVED}
        counts = Counter(listed.get(name, "unclassified") for name in survivors)
        killed = sum(code in KILLED for code in codes.values())
        unclassified += sorted(name for name in survivors if name not in listed)
        prefix = module.removesuffix(".py").replace("/", ".") + "."
        stale += sorted(name for name in listed if name.startswith(prefix) and name not in survivors)
        not_run += sorted(name for name, code in codes.items() if code not in KILLED | SURVIVED)
        judged = len(codes) - counts["equivalent"]
        score = f"{killed / judged:.1%}" if judged else "-"
        row = (len(codes), killed, len(survivors), counts["equivalent"], counts["accepted"],
               counts["unclassified"], score)
        print(f"{module:34}", *(f"{v:>8}" for v in row))
    lists = {f"unclassified survivors (mutmut show NAME; kill it or give it a row in {SURVIVORS})":
             unclassified, f"stale rows in {SURVIVORS} (no longer survive)": stale,
             "not run (mutmut results)": not_run}
    for title, names in lists.items():
        if names:
            print(f"\n{title}:", *names, sep="\n  ")
    return 1 if unclassified else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
