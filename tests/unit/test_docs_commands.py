"""Every `ddp ...` command shown in README.md and the docs site parses against the real CLI, and the site's
generated pages cover every command and every page is in the navigation.

A command line is checked for its command path (`ddp datasets check` exists) and for each `--flag` it
uses (an option of that command; torchrun's spellings too); values and positional arguments are not
checked. Code blocks in a shell or plain-text fence count (not toml, json or python); so do lines after
a `$ ` prompt, after `srun ...` and `torchrun ... -m ddp_cli`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import typer
import yaml
from conftest import REPO

from ddp_cli.cli import app
from ddp_cli.cli.clikit import dashed

DOCS = REPO / "docs"
GENERATED_PAGES = {DOCS / "reference" / "cli.md", DOCS / "reference" / "config.md"}  # the help itself
PAGES = [REPO / "README.md", *sorted(set(DOCS.rglob("*.md")) - GENERATED_PAGES)]
SHELL_FENCES = {"", "sh", "shell", "bash", "console", "text"}
ROOT = typer.main.get_command(app)

# `ddp` as a word (also `.venv/bin/ddp`), or `-m ddp_cli` (TorchX's `-m ddp_cli --`), then the rest
COMMAND = re.compile(r"(?:^|[\s/])(?:ddp|-m ddp_cli(?:\s+--)?)\s+(.*)$")
FLAG = re.compile(r"(?<![\w.=/-])(--?[A-Za-z][\w-]*)")
SHELL_SPLIT = re.compile(r"\s(?:\|\|?|&&|;|>>?|2>&1|2>)\s")  # ` | `, ` && `, redirections


def code_blocks(text: str):
    """(fence language, block text) of each fenced code block."""
    for match in re.finditer(r"^```([\w-]*)[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        yield match.group(1).lower(), match.group(2)


def logical_lines(block: str):
    """The block's lines, `\\` continuations joined, and a listing's indented continuation lines
    (README's "Commands": `ddp train CONFIG [...]` then `   [--flag ...]`) joined to their command."""
    lines: list[str] = []
    for line in block.replace("\\\n", " ").splitlines():
        if lines and line[:1].isspace() and line.strip()[:1] in "[-(" and "ddp" in lines[-1]:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return lines


def commands_in(block: str):
    """The text after `ddp` of each ddp command in a block, trailing comments dropped."""
    for line in logical_lines(block):
        line = re.sub(r"\s#\s.*$", "", line.strip().removeprefix("$ "))
        if line.startswith("#"):
            continue
        for part in SHELL_SPLIT.split(line):
            match = COMMAND.search(part)
            if match and re.match(r"[a-z-]", match.group(1)):  # not `│ ddp │ 0.1.0` in a table
                yield " ".join(match.group(1).split())


def shown_commands():
    """(page, the text after `ddp`) for every ddp command line in a shell block of README or the docs."""
    for page in PAGES:
        for fence, block in code_blocks(page.read_text()):
            if fence in SHELL_FENCES:
                for args in commands_in(block):
                    yield page.relative_to(REPO).as_posix(), args


def resolve(args: str):
    """The click command `args` names and the flags it uses (global ones before the name dropped)."""
    words = args.split()
    command, path = ROOT, ["ddp"]
    i = 0
    while hasattr(command, "commands"):
        while i < len(words) and words[i] in ("-v", "--verbose"):
            i += 1
        if i == len(words) or words[i].startswith("-"):  # `ddp --version`, `ddp --help`
            break
        name = words[i]
        if name not in command.commands and getattr(command, "default", None):  # `ddp sweep CONFIG`
            command, path = command.commands[command.default], [*path, command.default]
            break
        if name not in command.commands:
            raise LookupError(f"`{' '.join(path)}` has no command {name!r}")
        command, path = command.commands[name], [*path, name]
        i += 1
    return " ".join(path), command, FLAG.findall(" ".join(words[i:]).replace("[", " ").replace("(", " "))


def accepted(command) -> set[str]:
    """Every option spelling `command` takes, hidden ones included, and --help."""
    opts = {"--help"}
    for param in command.params:
        opts.update(getattr(param, "opts", ()), getattr(param, "secondary_opts", ()))
    return {opt for opt in opts if opt.startswith("-")}


def problems(args: str) -> list[str]:
    try:
        path, command, flags = resolve(args)
    except LookupError as error:
        return [str(error)]
    known = accepted(command)
    return [f"`{path}` takes no {flag}" for flag in flags if dashed([flag.split("=")[0]])[0] not in known]


COMMANDS = sorted(set(shown_commands()))


def test_the_docs_show_many_commands_from_every_kind_of_page():
    pages = {page for page, _ in COMMANDS}
    assert len(COMMANDS) > 60
    assert {"README.md", "docs/training.md", "docs/datasets.md", "docs/multi-node.md",
            "docs/evaluation.md", "docs/performance.md"} <= pages


@pytest.mark.parametrize(("page", "args"), COMMANDS, ids=[f"{p}: ddp {a}"[:90] for p, a in COMMANDS])
def test_every_command_shown_parses(page, args):
    assert problems(args) == [], f"{page}: ddp {args}"


def test_the_check_finds_unknown_commands_and_flags_and_takes_torchrun_spellings():
    assert problems("train cfg.toml --nproc_per_node 2 --set a.b=1 -v") == []
    assert problems("-v datasets check demo --split val --json") == []
    assert problems("--version") == []
    assert problems("train cfg.toml --epochs 3") == ["`ddp train` takes no --epochs"]
    assert problems("datasets frobnicate x") == ["`ddp datasets` has no command 'frobnicate'"]
    assert problems("sweep c.toml --space s.toml --trials 3") == []  # the group's default command
    assert problems("sweep c.toml --epochs 3") == ["`ddp sweep run` takes no --epochs"]
    assert problems("validate --checkpoint x.pt [--weights model|ema] [--topk 1,5,10]") == []
    listing = "train CONFIG [--set KEY=VALUE]... [--nnodes N|MIN:MAX] [--resume auto|never|PATH]"
    assert problems(listing) == []


def test_commands_are_picked_out_of_shell_lines():
    block = ("srun --nodes 4 ddp train c.toml --max-restarts 3\n"
             "ddp init w && cd w && ddp train demo.toml   # the demo\n"
             "# ddp train commented.toml\n"
             "torchrun --nproc-per-node 2 -m ddp_cli train c.toml\n"
             "torchx run dist.ddp -j 2x8 -m ddp_cli -- train c.toml --resume auto\n"
             "$ ddp train c.toml --json | tail -1 | jq .final\n"
             "ddp predict --checkpoint b.pt \\\n    --topk 1 --json > out.jsonl\n"
             "ddp bench scaling   (the same flags; --world-size N >= 2 is compared with 1)\n"
             "│ ddp                     │ 0.1.0 │\n")
    assert list(commands_in(block)) == [
        "train c.toml --max-restarts 3", "init w", "train demo.toml", "train c.toml",
        "train c.toml --resume auto", "train c.toml --json",
        "predict --checkpoint b.pt --topk 1 --json",
        "bench scaling (the same flags; --world-size N >= 2 is compared with 1)"]


def test_every_page_is_in_the_site_navigation():
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)

    def pages(entries):
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from pages(value) if isinstance(value, list) else [value]

    nav = set(pages(config["nav"]))
    on_disk = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert on_disk <= nav
    sys.path.insert(0, str(DOCS))
    try:
        import hooks
    finally:
        sys.path.remove(str(DOCS))
    assert nav == on_disk | set(hooks.GENERATED) | set(hooks.REPOSITORY_PAGES)


def test_the_generated_cli_reference_has_every_command_and_the_hidden_options():
    sys.path.insert(0, str(DOCS))
    try:
        import hooks
    finally:
        sys.path.remove(str(DOCS))
    page = hooks.cli_reference()
    from test_readme_commands import COMMANDS as LEAVES

    for name in LEAVES:
        assert f"`ddp {name}`" in page, name

    demo = typer.Typer()

    @demo.command()
    def run(workers: int = typer.Option(1, "--nproc-per-node", help="Workers."),
            alias: int = typer.Option(0, "--nproc_per_node", hidden=True)) -> None:
        pass

    @demo.command()
    def other() -> None:
        pass

    assert list(hooks.hidden_options(typer.main.get_command(demo))) == [("ddp run", ["--nproc_per_node"])]


def test_the_generated_config_reference_has_every_key():
    from ddp_cli.config import RunConfig
    from ddp_cli.config.errors import section_type
    from ddp_cli.config.reference import reference_markdown

    page = reference_markdown()

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            section = section_type(field.annotation)
            yield from keys(section, f"{prefix}{name}.") if section else [f"{prefix}{name}"]

    for key in keys(RunConfig):
        assert f"| `{key}` |" in page, key
    assert "## `[optim]`" in page and '`"sgd"` \\| `"adamw"`' in page


def test_the_pages_name_no_file_that_is_not_there():
    """Paths of the checkout a page names in backticks (`configs/...`, `ddp_cli/...`, `tests/...`)."""
    named = {(page.relative_to(REPO).as_posix(), path) for page in PAGES
             for path in re.findall(r"`((?:configs|ddp_cli|tests|benchmarks|tools)/[\w/.-]+\.(?:py|toml))`",
                                    page.read_text())}
    assert len(named) > 15
    assert [(page, path) for page, path in sorted(named) if not (REPO / path).exists()] == []


def test_pages_are_real_pages():
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        assert text.startswith("# "), page
        assert len(text.split()) > 150, f"{page} is a stub"


def test_the_pictures_are_there_and_shown():
    pictures = {path.name for path in (DOCS / "img").iterdir()}
    assert {"report.png", "report-classes.png", "progress.svg"} <= pictures
    shown = "".join(page.read_text() for page in DOCS.rglob("*.md"))
    for name in pictures:
        assert f"](img/{name})" in shown, name
    assert Path(DOCS / "img" / "progress.svg").stat().st_size < 50_000


def test_readme_links_into_the_docs_resolve():
    """README is read on the forge, outside the site: its links to docs/ pages and their headings hold."""
    from markdown.extensions.toc import slugify

    links = re.findall(r"\]\(((?:docs/)[^)#]+)(?:#([^)]+))?\)", (REPO / "README.md").read_text())
    assert len(links) > 15
    for target, anchor in links:
        page = REPO / target
        assert page.is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
            assert anchor in {slugify(h.replace("`", ""), "-") for h in headings}, f"{target}#{anchor}"


def test_the_committed_reference_pages_are_what_the_code_generates():
    """docs/reference/cli.md and config.md are generated and committed (read on the code host too)."""
    sys.path.insert(0, str(DOCS))
    try:
        import hooks
    finally:
        sys.path.remove(str(DOCS))
    assert hooks.stale_pages() == [], "run `python docs/hooks.py` to regenerate them"
