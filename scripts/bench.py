#!/usr/bin/env python
"""specjax benchmarks, one subcommand per mode.

  python scripts/bench.py ar --preset tiny20m --out runs/ar_tiny20m.json   # specjax AR vs transformers (CPU)
  python scripts/bench.py ar --preset 8b                                    # GPU: decode weight-read bandwidth

To add a mode (e.g. `spec`): write its logic in specjax/bench_<mode>.py with
`add_arguments(parser)` and `main(args) -> int`, and list it in MODES below.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# mode -> (module with add_arguments / main, one-line help)
MODES = {
    "ar": ("specjax.bench_ar", "autoregressive decode: specjax vs transformers (CPU) or 8B bandwidth (GPU)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode, (module_name, help_text) in MODES.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(mode, help=help_text, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(run=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as err:
        print(f"bench.py {args.mode}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
