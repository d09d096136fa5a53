"""The index built in a forked child beside the torch import: same index, same errors, no orphan.

The fork only happens in a process that has not imported torch, so these run in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from synthetic import make_imagenet_loc, write_registry

from ddp_cli.config import RunConfig
from ddp_cli.data.index_build import IndexBuild


def run_fresh(code: str) -> dict:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.processes
def test_the_child_builds_the_same_index_and_passes_errors_back_whole(tmp_path):
    make_imagenet_loc(tmp_path / "data")
    storage = {"driver": "FileSystem", "path": str(tmp_path / "data")}
    registry = write_registry(tmp_path, [{"name": "d", "layout": "imagenet-loc", "storage": storage}])
    _, here = IndexBuild(RunConfig.model_validate({"data": {"dataset": "d"}}), str(registry)).result()
    out = run_fresh(f"""
        import json, os, sys
        from ddp_cli.config import RunConfig
        from ddp_cli.errors import DdpError
        from ddp_cli.data.index_build import IndexBuild

        def attempt(dataset):
            cfg = RunConfig.model_validate({{"data": {{"dataset": dataset}}}})
            build = IndexBuild.begin(cfg, {str(registry)!r})
            forked = build.child is not None
            try:
                entry, index = build.result()
                return forked, {{s: list(map(str, f.paths)) for s, f in index.splits.items()}}
            except DdpError as e:
                return forked, [type(e).__name__, e.exit_code, str(e)]

        forked, index = attempt("d")
        unknown = attempt("nope")[1]
        os.rename({str(tmp_path / "data")!r}, {str(tmp_path / "gone")!r})
        missing = attempt("d")[1]
        pending = IndexBuild.begin(RunConfig.model_validate({{"data": {{"dataset": "d"}}}}), "unused")
        child = pending.child
        pending.close()
        print(json.dumps({{"forked": forked, "index": index, "unknown": unknown, "missing": missing,
                          "torch": "torch" in sys.modules, "closed": child.exitcode is not None}}))
    """)
    assert out["forked"] and not out["torch"] and out["closed"]
    assert out["index"] == {s: list(map(str, f.paths)) for s, f in here.splits.items()}
    assert out["unknown"][:2] == ["ConfigError", 2] and "unknown data set 'nope'" in out["unknown"][2]
    assert out["missing"][:2] == ["DataError", 3]


def test_where_torch_is_imported_the_index_is_built_in_place(tmp_path):
    """Once torch is imported, forking could copy its threads' locks mid-use: no child."""
    import torch  # noqa: F401

    build = IndexBuild.begin(RunConfig.model_validate({"data": {"dataset": "demo"}}), None)
    assert build.child is None
