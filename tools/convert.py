#!/usr/bin/env python3
"""Convert checkpoints between HuggingFace folders and moekit: ``python tools/convert.py --help``.

The same program as the ``moekit-convert`` command (``moekit.train.convert.main``).
"""
import sys

from moekit.train.convert import main

if __name__ == "__main__":
    sys.exit(main())
