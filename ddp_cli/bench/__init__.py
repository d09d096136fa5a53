"""`ddp bench ...`: one module per benchmark, each with one function returning a dict.

The dict's shape is shared so cli.py prints every bench the same way: `bench`
(its name), scalar facts about the set-up, and `rows`, a list of measurements
with the same keys (a table). `--json` prints the dict as it is.
"""
