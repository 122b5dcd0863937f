#!/usr/bin/env python3
"""Plan a load-balanced expert placement from a run's expert load: ``python tools/placement.py RUN_DIR --ep N``
(``--help`` for more).

The same program as the ``moekit-placement`` command (``moekit.train.placement.main``).
"""
import sys

from moekit.train.placement import main

if __name__ == "__main__":
    sys.exit(main())
