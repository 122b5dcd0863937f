"""The pieces of tools/train.py: config, data, checkpoints, records, the loop.

Not an installed package: tools/train.py puts tools/ on sys.path (Python does it for the script's
directory); tests do the same. Model code never imports from here.
"""


class UserError(Exception):
    """Bad input (flags, config, data, checkpoint): train.py prints the message as one line, exit 2."""
