#!/usr/bin/env python
"""specjax benchmarks (same as `specjax bench`), one subcommand per mode.

  python scripts/bench.py ar --preset tiny20m --out runs/ar_tiny20m.json   # specjax AR vs transformers (CPU)
  python scripts/bench.py ar --preset 8b                                    # GPU: decode weight-read bandwidth
  python scripts/bench.py spec --sweep --out runs/spec.json                 # drafters vs plain; replay sweep

A mode's logic lives in specjax/bench_<mode>.py (`add_arguments(parser)`, `main(args) -> int`),
registered in specjax/cli.py.
"""

import sys

from specjax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
