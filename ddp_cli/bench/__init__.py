"""`ddp bench ...`: benchmarks, a tool beside the product: the measurements and what they run with.
May import anything of the product but cli/; nothing of the product imports it (cli/bench.py is its door).

What is which:

- The product is `ddp` minus `bench`: its commands (ddp_cli/cli/ddp.py -> cli/commands/) and
  everything under them (preflight, run, train, data, ...). None of it imports ddp_cli.bench
  (tests/unit/test_layers.py: bench sits beside the commands; only `ddp`'s Typer app, which mounts
  the door `ddp_cli/cli/bench.py`, reaches it).
- ddp_cli/bench/ is the tool that ships with the package: the measurements `ddp bench` runs
  (one module per bench, each a function returning a dict), and what they need at run time:
  `faultproxy.py`, the latency/fault-injecting HTTP proxy that `bench data --latency-ms` puts in
  front of S3 (and that the S3 tests reuse), `metadata.py` (ImageNet-sized metadata) and
  `e2e_baseline.py` (the hand-written torchrun script `bench e2e` races). A bench may import
  anything of the product below the front door.
- benchmarks/ (top level, not installed) holds the scripts that reproduce BENCHMARKS.md sections
  `ddp bench` does not cover alone: they set up data at scale or need tools the package does not
  depend on (moto, webdataset, wids), then time the product or call `ddp bench`.

Every bench returns the same shape, so `cli.render.print_bench` prints them all alike: `bench` (its
name), scalar facts about the set-up, and `rows`, a list of measurements with the same keys (a
table). `--json` prints the dict as it is.
"""
