"""``moekit-convert average``: the weighted mean of several checkpoints of one model, written as a moekit model file
or a HuggingFace folder.

Averaging the last checkpoints of a run (LAWA, "checkpoint averaging" / merging) gives a model close to what the
run would reach after an LR decay, without one; it also smooths the noise of the last steps before an
evaluation or a release. Every source must have the same model config. Floating-point tensors (the weights, and
buffers such as the aux-loss-free routers' expert bias) are averaged in float32 and written back in their own
dtype; integer buffers must agree. One model is loaded at a time beside the running sum, so the memory is two
models.
"""
from __future__ import annotations

from pathlib import Path

import torch

from moekit.train import UserError


def sources(paths: list[str], last: int | None) -> list[Path]:
    """The checkpoints to average: ``paths`` as given, or with ``last`` K the K newest checkpoints of the one run
    directory in ``paths`` that verify (damaged ones skipped, as moekit-generate skips them)."""
    from moekit.train import checkpoint

    if last is None:
        if len(paths) < 2:
            raise UserError(f"average needs at least two sources, got {len(paths)}; list checkpoints (or model files), "
                            f"or pass one run directory with --last K")
        return [Path(p) for p in paths]
    if len(paths) != 1 or not checkpoint.checkpoint_root(paths[0]).is_dir():
        raise UserError(f"--last {last} takes one moekit-train run directory (its K newest checkpoints), got "
                        f"{' '.join(paths)}")
    if last < 2:
        raise UserError(f"--last {last} is invalid; average at least 2 checkpoints")
    found, skipped = checkpoint.newest_verified_many(paths[0], last)
    for reason in skipped:
        print(f"warning: skipped {reason}")
    good = [path for path, _ in found]
    if len(good) < last:
        raise UserError(f"--last {last}: {paths[0]} holds {len(good)} checkpoint(s) that verify; average fewer, or "
                        f"keep more while training (--checkpoint.keep)")
    return good[::-1]  # oldest first


def parse_weights(text: str | None, count: int) -> list[float]:
    """--weights W1,W2,...: one non-negative number per source, not all 0; normalised to sum to 1."""
    if text is None:
        return [1.0 / count] * count
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise UserError(f"--weights {text!r}: not numbers; give {count} comma-separated weights, e.g. "
                        f"{','.join(['1'] * count)}") from None
    if len(weights) != count:
        raise UserError(f"--weights {text!r} has {len(weights)} weight(s) for {count} sources; give one per source")
    if any(not (w >= 0 and w < float("inf")) for w in weights) or sum(weights) == 0:
        raise UserError(f"--weights {text!r}: each must be a finite number >= 0, and not all 0")
    return [w / sum(weights) for w in weights]


def check_configs(paths: list[Path]) -> None:
    """Every source holds the same model (its config), else one line naming the fields that differ."""
    from moekit.train.modelfiles import read_moekit_config

    first = read_moekit_config(paths[0]).to_dict()
    for path in paths[1:]:
        other = read_moekit_config(path).to_dict()
        differ = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
        if differ:
            shown = ", ".join(f"{k} {first.get(k)!r} vs {other.get(k)!r}" for k in differ[:4])
            raise UserError(f"{path} is another model than {paths[0]} ({shown}); average checkpoints of one model")


@torch.no_grad()
def average_models(paths: list[Path], weights: list[float], averaged: bool = False):
    """The model of ``paths[-1]`` holding the weighted mean of every source's tensors (``averaged``: of every
    checkpoint's parameter average, moekit.train.ema)."""
    from moekit.train.modelfiles import load_moekit

    total: dict[str, torch.Tensor] = {}
    model = None
    for path, w in zip(paths, weights):
        model = load_moekit(path, averaged=averaged)
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                if name in total and not torch.equal(total[name], t):
                    raise UserError(f"{path}: {name} (integers) differs from the other sources'; average checkpoints "
                                    f"of one model")
                total[name] = t.clone()
            elif name in total:
                total[name].add_(t.float(), alpha=w)
            else:
                total[name] = t.float() * w
    state = model.state_dict()
    model.load_state_dict({name: total[name].to(state[name].dtype) for name in state})
    return model


def average(args) -> None:
    """The command: check flags, OUT and the sources, average, write (and with --verify, reload and compare)."""
    from moekit.train.modelfiles import DTYPES, check_out, run_tokenizer, save_moekit, verify

    paths = [str(p) for p in args.paths]
    out = Path(args.out)
    to_file = out.suffix in (".safetensors", ".pt")
    srcs = sources(paths, args.last)
    weights = parse_weights(args.weights, len(srcs))
    check_out(out, folder=not to_file)
    check_configs(srcs)
    model = average_models(srcs, weights, args.ema)
    shown = ", ".join(f"{p} x {w:.3g}" for p, w in zip(srcs, weights)) + (": their parameter EMAs" if args.ema else "")
    if to_file:
        save_moekit(model, out)
        print(f"wrote {out}: the mean of {len(srcs)} sources ({shown})")
        written = out
    else:
        from moekit.models.hf import save_hf
        from moekit.models.hf.export import check_tokenizer_source

        tokenizer = Path(args.tokenizer) if args.tokenizer else run_tokenizer(srcs[-1])
        if tokenizer:
            check_tokenizer_source(tokenizer, f"the tokenizer {tokenizer}", "--tokenizer")
        dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
        written = save_hf(model, out, family=args.family, dtype=dtype, tokenizer_from=tokenizer)
        told = f", tokenizer from {tokenizer}" if tokenizer else ", no tokenizer (pass --tokenizer DIR to add one)"
        print(f"wrote {written}: the mean of {len(srcs)} sources ({shown}){told}")
    if args.verify:
        from moekit.models.hf import load_hf
        from moekit.train.modelfiles import load_moekit

        back = load_moekit(written) if to_file else load_hf(written, dtype="auto")
        verify(back, model.to(next(back.parameters()).dtype), f"average -> {written}")
