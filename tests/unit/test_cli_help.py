"""Every command's --help reads well in an 80-column terminal: whole option names, plain metavars.

Typer's defaults show `<int range>`, `<list[str]>`, `{config}` and, with torchrun's spellings listed
beside ddp's, cut option names short (`--nproc-per-node,…`). Rendered in-process at 80 columns.
"""

from __future__ import annotations

import re

import pytest
from conftest import every_command
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.cli.clikit import TORCHRUN_SPELLINGS, dashed

TYPER_METAVARS = re.compile(r"<(?:list\[|int|float|bool|str|path|text)[^>]*>|\{[a-z_]+\}")
COMMANDS = dict(every_command())


def help_text(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda path: " ".join(("ddp", *path)))
def test_help_fits_80_columns_with_whole_names_and_plain_metavars(path):
    text = help_text(path)
    assert [line for line in text.splitlines() if len(line) > 80] == []
    assert "…" not in text
    assert TYPER_METAVARS.findall(text) == []
    for param in COMMANDS[path].params:
        if param.param_type_name == "argument":
            assert re.search(rf"(?<![\w-]){re.escape(param.metavar or param.name.upper())}(?![\w-])", text)
        elif not param.hidden:
            primary = next((opt for opt in param.opts if opt.startswith("--")), param.opts[0])
            assert re.search(rf"(?<![\w-]){re.escape(primary)}(?![\w-])", text), primary


def test_torchruns_spellings_are_accepted_not_listed():
    text = help_text(("train",))
    listed = re.findall(r"^│\s*(--[\w-]+)", text, re.MULTILINE)
    assert "--nproc-per-node" in listed and not [name for name in listed if "_" in name]
    assert "torchrun's spellings (--nproc_per_node," in " ".join(text.split())


def test_dashed_reads_torchruns_spellings_as_ddps_up_to_a_double_dash():
    assert dashed(["--nproc_per_node", "4", "--node_rank=1", "--set", "a.b_c=1", "--", "--rdzv_id"]) == \
        ["--nproc-per-node", "4", "--node-rank=1", "--set", "a.b_c=1", "--", "--rdzv_id"]
    assert all(dashed([spelling]) == [ours] for spelling, ours in TORCHRUN_SPELLINGS.items())


def test_library_info_lines_stay_off_stderr_unless_verbose(capsys):
    """botocore logs "Found credentials in environment variables." at INFO on every S3 command: not ddp's
    line to print (the root logger is at INFO for ddp's own)."""
    import logging

    from ddp_cli.cli.clikit import configure_logging
    credentials = logging.getLogger("botocore.credentials")
    try:
        logging.getLogger().setLevel(logging.INFO)  # as `ddp`'s basicConfig leaves it for its own lines
        configure_logging(verbose=False)
        assert not credentials.isEnabledFor(logging.INFO)
        configure_logging(verbose=True)
        assert credentials.isEnabledFor(logging.DEBUG)
    finally:
        configure_logging(verbose=False)
        logging.getLogger().setLevel(logging.WARNING)
