#!/usr/bin/env python3
"""Generate text from a run, a checkpoint or a HuggingFace folder: ``python tools/generate.py RUN --prompt TEXT``.

The same program as the ``moekit-generate`` command (``moekit.train.generate.main``); ``--help`` lists the
flags, docs/generation.md describes sampling, the KV cache and the context window.
"""
import sys

from moekit.train.generate import main

if __name__ == "__main__":
    sys.exit(main())
