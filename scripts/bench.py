#!/usr/bin/env python
"""specjax benchmarks (same as `specjax bench`), one subcommand per mode.

  python scripts/bench.py ar --preset tiny20m --out runs/ar_tiny20m.json   # specjax AR vs transformers (CPU)
  python scripts/bench.py ar --preset 8b                                    # GPU: decode weight-read bandwidth
  python scripts/bench.py spec --sweep --out runs/spec.json                 # drafters vs plain; replay sweep
  python scripts/bench.py spec --preset tiny20m --batches 1,8               # random target + draft, CPU
  python scripts/bench.py spec --preset 8b                                  # GPU: B=1,8,64, draft model + replay

A mode's logic lives in specjax/bench_<mode>.py (`add_arguments(parser)`, `main(args) -> int`),
registered in specjax/cli.py.
"""

import sys

from specjax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
