#!/usr/bin/env python3
"""Expert-load heatmaps of a training run: ``python tools/heatmap.py RUN_DIR`` (``--help`` for more).

The same program as the ``moekit-heatmap`` command (``moekit.train.heatmap.main``).
"""
import sys

from moekit.train.heatmap import main

if __name__ == "__main__":
    sys.exit(main())
