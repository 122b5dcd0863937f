"""The flags naming a model to load, shared by moekit-generate and moekit-eval: PATH, --device, --dtype, --ema.

Imports no torch, so the programs answer ``--help`` and flag errors at once; ``moekit.train.inference``
resolves the values (``resolve_device``, ``resolve_dtype``) when a model is loaded.
"""
from __future__ import annotations

import argparse

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the keys of moekit.train.inference.DTYPES


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model to load and where: PATH, --device, --dtype, --ema (``load_for_inference``'s arguments)."""
    p.add_argument("path", metavar="RUN_DIR|CHECKPOINT|HF_DIR|MODEL_FILE",
                   help="a run directory (its newest checkpoint that verifies), RUN_DIR/checkpoints/step_N, a "
                        "HuggingFace model folder, or a moekit model file (*.safetensors, *.pt: moekit-convert's "
                        "hf-to-moekit, average, prune)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="a moekit model file's tokenizer: the run directory it was trained in, or the HF folder it "
                        "came from (the other sources carry their own)")
    p.add_argument("--device", default="auto", metavar="D", help="auto (CUDA when available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", metavar="T",
                   help=f"parameter dtype: auto (bfloat16 on CUDA, float32 on CPU), {', '.join(DTYPE_NAMES)}")
    p.add_argument("--ema", action="store_true",
                   help="load the checkpoint's parameter average (a run trained with --train.ema_decay) instead of "
                        "its trained weights")
