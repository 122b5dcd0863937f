#!/usr/bin/env python3
"""Evaluate a run, a checkpoint or a HuggingFace folder on held-out data: ``python tools/evaluate.py RUN``.

The same program as the ``moekit-eval`` command (``moekit.train.evaluate.main``): loss, perplexity, bits per
byte and the expert load of the data; ``--help`` lists the flags, docs/generation.md describes them.
"""
import sys

from moekit.train.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
