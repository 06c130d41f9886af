#!/usr/bin/env python
"""Convert a Hugging Face model directory to a specjax orbax checkpoint (same as `specjax convert`)."""

import sys

from specjax.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
