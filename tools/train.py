#!/usr/bin/env python3
"""Train a moekit model: ``python tools/train.py [--preset mixtral-tiny] [--steps N] ...``.

With no arguments it trains mixtral-tiny on the embedded corpus (a few minutes on a laptop CPU) and
writes runs/mixtral-tiny/. ``--help`` lists the flags, ``--print-config`` every setting; the run
directory and record formats are described in docs/training.md.
"""
import os
import sys

_TOOLS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TOOLS)
for _p in (_TOOLS, _ROOT):  # trainlib lives beside this script; models/moe when moekit is not installed
    if _p not in sys.path:
        sys.path.insert(0, _p)

from trainlib.loop import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
