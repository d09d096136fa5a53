"""MkDocs hook: the pages generated from the code, never edited by hand.

`reference/cli.md` and `reference/config.md` are generated from the code and committed, so that they read
on the code host too: `python docs/hooks.py` rewrites them (`make docs` and `make test` fail while they
differ from what the code generates; tests/unit/test_docs_commands.py checks it too).

- `reference/cli.md`: the help of every `ddp` command, from the Typer app as `ddp_cli.cli` defines it
  when the site is built (Typer's own Markdown renderer, the one behind `typer ... utils docs`), plus
  the options hidden from `--help` that the commands still accept.
- `reference/config.md`: every run-config key, its default and description, from the pydantic models
  (`ddp_cli.config.reference.reference_markdown`).
- `benchmarks.md` and `changelog.md`: BENCHMARKS.md and CHANGELOG.md from the repository root, and
  `benchmarks/reports/*.md`, the dated reports it links to (in the site, out of the navigation).

Pages are written to be read on the code host too, so they link to files of the repository
(`../BENCHMARKS.md#storage`, `../../BENCHMARKS.md`): `on_page_markdown` rewrites each such link to the
page the site made of that file.

mkdocs.yml names this file under `hooks:`; `make docs` and `make test` build with `--strict`.
"""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

log = logging.getLogger("mkdocs.hooks.reference")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the checkout's ddp_cli, whatever is installed
    sys.path.insert(0, str(ROOT))


def cli_reference() -> str:
    import click
    import typer
    import typer.cli

    from ddp_cli.cli import app

    root = typer.main.get_command(app)
    ctx = click.Context(root, info_name="ddp")
    body = typer.cli.get_docs_for_click(obj=root, ctx=ctx, name="ddp", title="ddp")
    body = body.split("\n", 1)[1]  # Typer's own title: the page has one
    body = re.sub(r"^(#+) `ddp", r"#\1 `ddp", body, flags=re.MULTILINE)  # its sections under the page's
    hidden = "\n".join(f"- `{path}`: {', '.join(f'`{opt}`' for opt in opts)}"
                       for path, opts in hidden_options(root))
    hidden_section = ["## Hidden options", "",
                      "Accepted, but left out of `--help` (spellings kept for other tools' habits):", "",
                      hidden, ""] if hidden else []
    return "\n".join([
        "# Command line reference",
        "",
        "Generated from the code when this site is built: the help of every command, as",
        "`ddp COMMAND --help` prints it. Every command also takes `-v/--verbose` before or after its",
        "name; what `--json` prints and the exit codes are in [Scripting](scripting.md).",
        "",
        "## `ddp`",
        "",
        body.strip(),
        "",
        *hidden_section,
    ])


def hidden_options(group, path: tuple[str, ...] = ("ddp",)):
    """(`ddp train`, [--opt, ...]) for each command with options hidden from its help."""
    for name, command in getattr(group, "commands", {}).items():
        yield from hidden_options(command, (*path, name))
    opts = [opt for param in getattr(group, "params", []) if getattr(param, "hidden", False)
            for opt in (*param.opts, *getattr(param, "secondary_opts", []))]
    if opts:
        yield " ".join(path), opts


def config_reference() -> str:
    from ddp_cli.config.reference import reference_markdown

    return "\n".join([
        "# Run config reference",
        "",
        "Every key of a run config, generated from the pydantic models when this site is built.",
        "Set a key in the TOML file (`[optim]` then `lr = 0.2`) or on the command line",
        "(`--set optim.lr=0.2`). Unknown keys are refused with a did-you-mean (exit 2); `unset`",
        "means no value (TOML has no null); `required` must be given when its section is.",
        "`ddp config show CONFIG` prints a config with every default filled in, and `ddp config schema`",
        "its JSON schema (see [Training](../training.md#inspecting-a-config-ddp-config-show-schema)).",
        "",
        reference_markdown(),
        "",
    ])


GENERATED = {"reference/cli.md": cli_reference, "reference/config.md": config_reference}


def stale_pages() -> list[str]:
    """The committed generated pages that differ from what the code generates now."""
    docs = ROOT / "docs"
    return [uri for uri, make in GENERATED.items()
            if not (docs / uri).is_file() or (docs / uri).read_text() != make()]


def on_files(files: Files, config) -> Files:
    stale = stale_pages()
    if stale:
        log.warning("out of date with the code: %s; run `python docs/hooks.py`",
                    ", ".join(f"docs/{uri}" for uri in stale))
    for uri, path in REPOSITORY_PAGES.items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / path)))
    for report in sorted((ROOT / "benchmarks" / "reports").glob("*.md")):
        files.append(File.generated(config, f"benchmarks/reports/{report.name}", abs_src_path=str(report),
                                    inclusion=InclusionLevel.NOT_IN_NAV))
    return files


# pages the site takes from the repository's root, as they are
REPOSITORY_PAGES = {"benchmarks.md": "BENCHMARKS.md", "changelog.md": "CHANGELOG.md"}


def repo_path(uri: str) -> str:
    """The repository file a site page is made from."""
    if uri in REPOSITORY_PAGES:
        return REPOSITORY_PAGES[uri]
    return uri if uri.startswith("benchmarks/reports/") else f"docs/{uri}"


def site_uri(path: str) -> str | None:
    """The site page made from a repository file, if the site has one."""
    for uri, source in REPOSITORY_PAGES.items():
        if path == source:
            return uri
    if path.startswith("benchmarks/reports/"):
        return path
    if path.startswith("docs/"):
        return path[len("docs/"):]
    return None


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Links written for the code host (to `../BENCHMARKS.md`, `benchmarks/reports/...`) as the site's."""
    uri = page.file.src_uri
    here = posixpath.dirname(repo_path(uri))

    def rewrite(match: re.Match) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        path = posixpath.normpath(posixpath.join(here, target))
        page_uri = site_uri(path)
        if page_uri is None or page_uri == posixpath.normpath(posixpath.join(posixpath.dirname(uri), target)):
            return match.group(0)
        return f"]({posixpath.relpath(page_uri, posixpath.dirname(uri) or '.')}{anchor})"

    return LINK.sub(rewrite, markdown)


if __name__ == "__main__":  # python docs/hooks.py: rewrite the generated pages from the code
    for uri, make in GENERATED.items():
        (ROOT / "docs" / uri).write_text(make())
        print(f"wrote docs/{uri}")
