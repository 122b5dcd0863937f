"""moekit's trainer as a library (``moekit.train``): config, data, checkpoints, records, the loop, and the
command-line programs built on them (``moekit-train``, ``moekit-heatmap``, ``moekit-convert``).

The top layer: it imports ``moekit.models``, ``moekit.comm`` and ``moekit.moe``; none of them imports it.
"""


class UserError(Exception):
    """Bad input (flags, config, data, checkpoint): the programs print the message as one line, exit 2."""



def program_name(script: str) -> str:
    """The name for usage and error lines: the console script (``moekit-train``) when started as one, else
    ``script`` (``train.py``, as from ``python tools/train.py`` or a call of ``main()`` from Python)."""
    import os
    import sys

    name = os.path.basename(sys.argv[0]) if sys.argv else ""
    return name if name.startswith("moekit-") else script
