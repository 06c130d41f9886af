"""Write docs/cli.md, the `specjax` command's reference, from its argparse parser (specjax/cli.py: build_parser).

    python docs/gen_cli.py            # rewrite docs/cli.md
    python docs/gen_cli.py --check    # exit 1 when docs/cli.md is not this script's output (tests/test_docs.py)

Every subcommand's `--help`, as argparse prints it at a fixed width of 100 columns, so the page does not depend on
the terminal that wrote it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

PAGE = pathlib.Path(__file__).resolve().parent / "cli.md"
WIDTH = "100"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _sections(parser: argparse.ArgumentParser, name: str, level: int) -> list[str]:
    out = [f"{'#' * level} `{name}`", "```text\n" + parser.format_help().rstrip() + "\n```"]
    for sub_name, sub in _subcommands(parser).items():
        out += _sections(sub, f"{name} {sub_name}", min(level + 1, 4))
    return out


def render() -> str:
    """The whole page: the top-level help, then every subcommand's, in the parser's order."""
    os.environ["COLUMNS"] = WIDTH  # argparse reads the width from here
    from specjax.cli import build_parser

    head = ("# CLI reference\n\nGenerated from the argparse parser in `specjax/cli.py` by `python docs/gen_cli.py`; "
            "`tests/test_docs.py` checks it is up to date. `specjax demo` and `specjax generate` are introduced in "
            "[Install](install.md) and [Load, convert and export](loading.md).")
    return "\n\n".join([head] + _sections(build_parser(), "specjax", 2)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/cli.md is out of date")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if PAGE.read_text() != page:
            print(f"{PAGE} is out of date: run python docs/gen_cli.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
