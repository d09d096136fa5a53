"""What a person reads: every command's result as rich tables and lines, and the progress bar.

The commands return plain dicts (what `--json` prints as they are); the functions here draw the
same dicts for a terminal. Results go to stdout (`Console()`), progress and messages to stderr
(`err`).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Column, Table

from ddp_cli.observe.classes import describe

err = Console(stderr=True)


def print_mapping(title: str, result: dict[str, Any]) -> None:
    """A dict as a two-column table, a key a row."""
    table = Table(title=title, title_justify="left", show_header=False)
    for key, value in result.items():
        table.add_row(key, _cell(value))
    Console().print(table)


def print_train_summary(result: dict[str, Any]) -> None:
    """The last epoch's validation of the weights the run serves (best.pt's kind: the EMA's where
    `weights` says so), the other weights' beside it, and best_top1 as result.json has it."""
    final, ema = result["final"], result.get("final_ema")
    served, other = (ema, final) if ema and result.get("weights") == "ema" else (final, ema)
    names = ("EMA", "trained") if served is ema else ("trained", "EMA")
    lines = [f"[bold green]done[/] {_scores(served)} on {served['images']} val images, {names[0]} weights  "
             f"({result['images_per_second']:.0f} img/s{_mfu(result)})"]
    lines += [f"            {names[1]} weights: {_scores(other)}"] if other else []
    lines += [f"best:       top-1 {result['best_top1']:.4f} ({names[0]} weights, in best.pt)"] \
        if result.get("best_top1", -1) >= 0 else []
    lines += [f"run:        {result['run_dir']}", f"checkpoint: {result['checkpoint']}"]
    Console().print("\n".join(lines), highlight=False, soft_wrap=True)
    if result.get("io_retries"):
        Console().print(f"storage:    {result['io_retries']} transient error(s) retried (data.io_retries)",
                        highlight=False)
    if result.get("pruned_at_epoch"):
        Console().print(f"pruned:     after epoch {result['pruned_at_epoch']} by the sweep's pruner",
                        highlight=False)


def _mfu(result: dict[str, Any]) -> str:
    """", MFU 29.9%" where the run reports it (docs/performance.md)."""
    return f", MFU {result['mfu']:.1%}" if result.get("mfu") is not None else ""


def _scores(val: dict[str, Any]) -> str:
    return f"top-1 {val['top1']:.4f}  top-5 {val['top5']:.4f}  loss {val['loss']:.4f}"


def print_validation(result: dict[str, Any]) -> None:
    """The numbers; with --per-class, a table of every class, worst first."""
    print_mapping("validation", {k: v for k, v in result.items() if k != "per_class"})
    if "per_class" not in result:
        return
    table = Table("class", "synset", "description", "images", "top-1", title="per class, worst first",
                  title_justify="left")
    for row in sorted(result["per_class"], key=lambda r: (r["top1"] is None, r["top1"] or 0.0, r["index"])):
        top1 = "-" if row["top1"] is None else f"{row['top1']:.4f}"
        table.add_row(str(row["index"]), escape(row["synset"]), escape(row["description"]),
                      str(row["images"]), top1)
    Console().print(table)


def print_predictions(answers: list[dict[str, Any]]) -> None:
    """One row per input: its best class and probability, then the rest of its top-k (or its error)."""
    table = Table(Column("input", overflow="fold"), "class", "probability", "then", title="predictions",
                  title_justify="left")
    here = os.getcwd() + os.sep
    for item in answers:
        path = escape(item["path"].removeprefix(here))
        if "error" in item:
            table.add_row(path, "[red]error[/red]", "", escape(item["error"]))
            continue
        best, *rest = item["topk"]
        table.add_row(path, escape(f"{best['synset']} {best['description']}"),
                      f"{best['probability']:.3f}",
                      escape(", ".join(f"{r['description']} {r['probability']:.3f}" for r in rest)))
    Console().print(table)


def print_export(result: dict[str, Any]) -> None:
    err.print(f"wrote {result['out']} ({result['format']}, {result['weights']} weights, "
              f"{result['bytes'] / 2**20:.1f} MiB)\nsha256 {result['sha256']}\ncard   {result['card']}",
              markup=False, highlight=False, soft_wrap=True)


def print_datasets(rows: list[dict[str, Any]]) -> None:
    table = Table("name", "driver", "layout", "path", "description")
    for row in rows:
        table.add_row(row["name"], row["driver"], row["layout"], row["path"], row["description"])
    Console().print(table)


def print_dataset(result: dict[str, Any]) -> None:
    """The registry entry, its split sizes and its first ten classes."""
    entry = {k: v for k, v in result.items() if k not in ("splits", "classes", "storage")}
    print_mapping(result["name"], entry | {f"storage.{k}": v for k, v in result["storage"].items()})
    print_splits(result["splits"])
    classes = Table("label", "synset", "description", title=f"{len(result['classes'])} classes",
                    title_justify="left")
    for row in result["classes"][:10]:
        classes.add_row(str(row["index"]), row["synset"], row["description"])
    if len(result["classes"]) > 10:
        classes.add_row("...", f"{len(result['classes']) - 10} more", "(--json lists all)")
    Console().print(classes)


def print_splits(splits: dict[str, dict[str, int]], columns: tuple[str, ...] = ("images", "classes")) -> None:
    table = Table("split", *columns)
    for split, counts in splits.items():
        table.add_row(split, *(str(counts[column]) for column in columns))
    Console().print(table)


def print_check(result: dict[str, Any]) -> None:
    """Split sizes, then every bad file with its reason (whole paths, wrapped, never cut)."""
    print_splits(result["splits"])
    if not result["bad_files"]:
        Console().print(f"[green]no bad files[/] ({result['seconds']:.1f} s)")
        return
    table = Table(title=f"{len(result['bad_files'])} bad files under {result['root']}", title_justify="left")
    table.add_column("path", overflow="fold")
    table.add_column("reason", overflow="fold")
    for bad in result["bad_files"]:
        table.add_row(bad["path"], bad["reason"])
    Console().print(table)


def print_pack(result: dict[str, Any]) -> None:
    table = Table("split", "images", "shards", "MiB", "skipped", title=f"packed into {result['to']}",
                  title_justify="left")
    for split, row in result["splits"].items():
        table.add_row(split, str(row["images"]), str(row["shards"]), f"{row['bytes'] / 2**20:.1f}",
                      str(row["skipped"]))
    Console().print(table)
    Console().print(f"index: {result['index']} ({result['seconds']:.1f} s)")


def print_index(result: dict[str, Any]) -> None:
    print_splits(result["splits"], ("images", "shards"))
    Console().print(f"index: {result['index']}")


def print_starter(result: dict[str, Any]) -> None:
    """What `ddp init` wrote, and the command that trains it."""
    names = [Path(path).name for path in result["files"]]
    configs = [name for name in names if name != "data.toml"]  # the registry: ./data.toml there
    lines = [f"wrote {', '.join(names)} to {result['dir']}"]
    lines += [f"train: cd {shlex.quote(result['dir'])} && ddp train {configs[0]}"] if configs else []
    Console().print("\n".join(lines), highlight=False, soft_wrap=True)


def print_report(summary: dict[str, Any]) -> None:
    """`ddp report`'s summary, its worst classes one a line."""
    if "worst_classes" in summary:
        summary = {**summary, "worst_classes": describe(summary["worst_classes"])}
    print_mapping("report", summary)


def print_env(info: dict[str, Any]) -> None:
    """`ddp env` as one two-column table, a fact a row."""
    cpu, backends = info["cpu"], info["backends"]
    bf16 = (f"native ({', '.join(cpu['bf16_flags'])})" if cpu["bf16_native"] else
            "not native (no AVX-512 BF16 / AMX): emulated, slower than fp32")
    gpus = [f"{g['index']}: {g['name']}, {g['memory_gib']} GiB, compute {g['capability']}"
            for g in info["gpus"]]
    refused = f"refused: {info.get('auto_refused')}"
    rows = {
        "ddp": info["ddp"], "python": f"{info['python']} ({info['platform']})",
        "torch": info["torch"], "torchvision": info["torchvision"],
        "CUDA": f"{info['cuda'] or 'none (CPU build)'}; available: {_yes(info['cuda_available'])}",
        "cuDNN": info["cudnn"] or "none", "NCCL": info["nccl"] or "none",
        "GPUs": "\n".join(gpus) or "none",
        **({"NVIDIA driver": f"{nvidia['driver']} (runs CUDA {nvidia['cuda']}), {nvidia['gpus']} GPU(s)"}
           if (nvidia := info.get("nvidia")) else {}),
        **({"GPU problem": info["gpu_problem"]} if info.get("gpu_problem") else {}),
        "CPU": f"{cpu['model']}, {cpu['count']} CPUs ({cpu['usable']} usable by this process)",
        "CPU bf16": bf16,
        "memory": f"{info['memory_gib']} GiB",
        "backends": ", ".join(f"{name} {_yes(ok)}" for name, ok in backends.items()),
        'precision = "auto"': info["precision_auto"] or refused,
        'backend = "auto"': info["backend_auto"] or refused,
        'nproc_per_node = "auto"': str(info["nproc_per_node_auto"] or refused),
        "settings": " ".join(f"{k}={v}" for k, v in info["settings"].items()) or "none set",
    }
    table = Table(title="ddp env", title_justify="left", show_header=False)
    for key, value in rows.items():
        table.add_row(key, value)
    Console().print(table, highlight=False)


def print_bench(result: dict[str, Any], table: str = "rows") -> None:
    """Every bench the same way: its `table` (`rows`) as a table, then the other keys (see ddp_cli/bench)."""
    rows = result[table]
    out = Table(*rows[0], title=f"bench {result['bench']}", title_justify="left")
    for row in rows:
        out.add_row(*(_fmt(v) for v in row.values()))
    Console().print(out)
    print_mapping("set-up and result", {k: v for k, v in result.items() if k not in ("bench", table)})


@contextmanager
def progress_bar(enabled: bool, label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A rich bar on stderr (TTY only); yields `update(done, total)`, or None when disabled."""
    if not enabled:
        yield None
        return
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _cell(value: Any) -> str:
    """A mapping's value: a list of strings one per line (a pipeline's steps, in order), other
    containers as JSON."""
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return json.dumps(value) if isinstance(value, dict | list) else _fmt(value)


def _fmt(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(_fmt(v) for v in value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _params(params: dict[str, Any]) -> str:
    return "  ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                     for key, value in params.items())


def print_sweep_trial(row: dict[str, Any]) -> None:
    """One line on stderr as each trial of a sweep ends."""
    value = "-" if row.get("value") is None else f"{row['value']:.4f}"
    state = {"complete": "[green]complete[/]", "pruned": f"[yellow]pruned at epoch {row.get('epochs')}[/]",
             "failed": "[red]failed[/]"}[row["state"]]
    err.print(f"trial {row['trial']}: {state}  value {value}  ({row['seconds']:.0f} s)  "
              f"{escape(_params(row['params']))}" + (f"  {escape(row['error'])}" if row.get("error") else ""),
              highlight=False, soft_wrap=True)


def print_sweep(result: dict[str, Any]) -> None:
    counts = result["trials"]
    best = result["best"]
    Console().print(
        f"[bold green]done[/] study {escape(result['study'])}: {counts['complete']} complete, "
        f"{counts['pruned']} pruned, {counts['failed']} failed\n"
        + (f"best:   trial {best['trial']}, value {best['value']:.4f}  {escape(_params(best['params']))}\n"
           f"config: {best['config']}\n" if best else "best:   none (no trial complete)\n")
        + f"sweep:  {result['sweep_dir']}", highlight=False)


def print_sweep_report(result: dict[str, Any]) -> None:
    """The trials as a table (best first), then the best config and the plots written."""
    keys = sorted({key for row in result["trials"] for key in row["params"]})
    leaves = [key.rpartition(".")[2] for key in keys]
    heads = leaves if len(set(leaves)) == len(leaves) else keys  # `lr_per_256`, where that is unique
    table = Table("trial", "state", result["metric"], *heads, "epochs", "seconds",
                  title=f"study {escape(result['study'])} ({result['direction']}, pruner {result['pruner']})",
                  title_justify="left")
    sign = -1 if result["direction"] == "maximize" else 1
    for row in sorted(result["trials"],
                      key=lambda r: (r["value"] is None, sign * (r["value"] or 0), r["trial"])):
        value = "-" if row["value"] is None else f"{row['value']:.4f}"
        cells = [f"{row['params'][k]:.4g}" if isinstance(row["params"].get(k), float)
                 else str(row["params"].get(k, "-")) for k in keys]
        table.add_row(str(row["trial"]), row["state"], value, *cells, str(row["epochs"] or "-"),
                      "-" if row["seconds"] is None else f"{row['seconds']:.0f}")
    Console().print(table)
    best = result["best"]
    lines = [f"best config: {best['config']} (trial {best['trial']})" if best else "best config: none yet"]
    lines += [f"{name}: {path}" for name, path in result["plots"].items()]
    lines += [f"{name}: not drawn ({escape(why)})" for name, why in result.get("plots_skipped", {}).items()]
    Console().print("\n".join(lines), highlight=False)
