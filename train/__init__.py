"""moekit's trainer as a library (``moekit.train``): config, data, checkpoints, records, the loop, and the
command-line programs built on them (``moekit-train``, ``moekit-heatmap``, ``moekit-convert``).

The top layer: it imports ``moekit.models``, ``moekit.comm`` and ``moekit.moe``; none of them imports it.
"""


class UserError(Exception):
    """Bad input (flags, config, data, checkpoint): the programs print the message as one line, exit 2."""
