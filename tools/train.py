#!/usr/bin/env python3
"""Train a moekit model: ``python tools/train.py [--preset mixtral-tiny] [--steps N] ...``.

The same program as the ``moekit-train`` command (``moekit.train.loop.main``). With no arguments it trains
mixtral-tiny on the embedded corpus (a few minutes on a laptop CPU) and writes runs/mixtral-tiny/.
``--help`` lists the flags, ``--print-config`` every setting; docs/training.md describes the run directory.
"""
import sys

from moekit.train.loop import main

if __name__ == "__main__":
    sys.exit(main())
