#!/usr/bin/env python3
"""Router sweep: train one model under several routers, then one comparison report: ``python tools/sweep.py
--runs-dir runs/sweep --base "--steps 100" --variant topk="--router topk" --variant switch="--router switch"``
(``--help`` for more).

The same program as the ``moekit-sweep`` command (``moekit.train.sweep.main``).
"""
import sys

from moekit.train.sweep import main

if __name__ == "__main__":
    sys.exit(main())
