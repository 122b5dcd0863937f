#!/usr/bin/env python3
"""Tokenize documents into a moekit token file: ``python tools/prepare.py 'data/*.jsonl' --tokenizer DIR -o data/train.bin``.

The same program as the ``moekit-prepare`` command (``moekit.train.prepare.main``). ``--help`` lists the
flags; docs/training.md ("Data") describes the files it writes and how ``moekit-train --data.path`` uses them.
"""
import sys

from moekit.train.prepare import main

if __name__ == "__main__":
    sys.exit(main())
