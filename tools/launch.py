#!/usr/bin/env python3
"""A Slurm batch script for a multi-node run: ``python tools/launch.py slurm --nodes 4 --gpus-per-node 8 --time
2-00:00:00 -o job.sbatch -- --preset mixtral-1b --fsdp 32 --ep 8`` (``--help`` for more).

The same program as the ``moekit-launch`` command (``moekit.train.launch.main``).
"""
import sys

from moekit.train.launch import main

if __name__ == "__main__":
    sys.exit(main())
