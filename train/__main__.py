"""``python -m moekit.train`` (also ``torchrun -m moekit.train``): the same program as ``moekit-train``."""
import sys

from moekit.train.loop import main

sys.exit(main())
