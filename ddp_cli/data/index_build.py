"""The run's data set and index table, built in a process of its own while the launcher imports torch.

`ddp train` spends seconds importing torch and torchvision, and at ImageNet
size seconds more reading the listing into the index (pandas and numpy, no
torch). Neither needs the other, so `IndexBuild.begin` forks a child that
builds the index before this process imports torch (forking is safe then: no
torch threads, no CUDA), and `result()` takes it back over a pipe as numpy
buffers: packed buffers, so ranks and loader processes share the pages instead of copying Python
strings. Where
torch is imported already (an in-process caller, a test), the index is built
in place at `result()`, as it is when `fork` is false.
"""

from __future__ import annotations

import multiprocessing
import pickle
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from ddp_cli.config import RunConfig
from ddp_cli.data.registry import DatasetEntry, load_registry
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.data.sources.unlabeled import UNLABELED, unlabeled_split
from ddp_cli.errors import ConfigError, DdpError


def resolve_dataset(cfg: RunConfig, registry: str | None, classes: list[str] | None = None,
                    splits: tuple[str, ...] = ("train", "val"),
                    entry: DatasetEntry | None = None) -> tuple[DatasetEntry, IndexTable]:
    """The registry entry (`data.dataset`, unless given) and its index table, built once per run in
    the launcher: a row naming an unsafe path stops the run here under on_bad_image = "error"."""
    entry = entry or load_registry(registry).get(cfg.data.dataset)
    fs, root = entry.open()
    index = build_index(fs, root, entry.layout, classes or cfg.data.classes, splits, cfg.data.on_bad_image,
                        entry.layout_options)
    if entry.unlabeled and (cfg.semi.on() or cfg.pretrain.on()) and "train" in splits:  # nobody's labels
        index.splits[UNLABELED] = unlabeled_split(fs, root, entry.layout, entry.unlabeled,
                                                 cfg.data.on_bad_image)
    for split, frame in index.splits.items():
        if not len(frame):
            raise ConfigError(f"data set {entry.name!r}: the {split} split has no images "
                              "(check data.classes and the root)")
    return entry, index


class IndexBuild:
    """`resolve_dataset` for a run, begun early; `result()` has it, or raises what it raised."""

    def __init__(self, cfg: RunConfig, registry: str | None) -> None:
        self.cfg, self.registry = cfg, registry
        self.child: multiprocessing.process.BaseProcess | None = None
        self.pipe: Connection | None = None

    @classmethod
    def begin(cls, cfg: RunConfig, registry: str | None, fork: bool = True) -> IndexBuild:
        """Start building in a forked child, if `fork` and torch is not imported yet."""
        build = cls(cfg, registry)
        if fork and "torch" not in sys.modules:
            context = multiprocessing.get_context("fork")
            build.pipe, sending = context.Pipe(duplex=False)
            build.child = context.Process(target=build_into, args=(sending, cfg, registry),
                                          name="ddp-index", daemon=True)
            build.child.start()
            sending.close()
        return build

    def result(self) -> tuple[DatasetEntry, IndexTable]:
        if self.child is None:
            return resolve_dataset(self.cfg, self.registry)
        try:
            built, value = self.pipe.recv()
        except EOFError:
            raise RuntimeError(f"the index build process died (exit code {self.child.exitcode})") from None
        finally:
            self.close()
        if not built:
            raise value
        return value

    def close(self) -> None:
        """Stop the child if it still runs (a check failed first, or the command ended)."""
        if self.child is not None:
            self.child.kill()
            self.child.join()
            self.pipe.close()
            self.child = None

    def __enter__(self) -> IndexBuild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_into(pipe: Connection, cfg: RunConfig, registry: str | None) -> None:
    """The child: the entry and index, or the exception it met."""
    try:
        message: tuple[bool, Any] = (True, resolve_dataset(cfg, registry))
    except Exception as e:  # noqa: BLE001 - every failure goes back to the launcher, which reports it
        if not isinstance(e, DdpError):  # a bug: DDP_DEBUG=1 shows where, in this process
            e.add_note(traceback.format_exc())
        message = (False, e if picklable(e) else RuntimeError(f"{type(e).__name__}: {e}"))
    pipe.send(message)
    pipe.close()


def picklable(error: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - whatever pickling raises, the answer is no
        return False
    return True
