"""Expert pruning: a smaller MoE that keeps, in every MoE layer, the N experts its routing uses most.

    moekit-eval SRC --data calib.bin --split all --select-experts scores.json     # score every expert
    moekit-convert prune SRC --scores scores.json --keep N -o OUT [--by gate|token|reap] [--verify]

The scores are a ``moekit-eval --select-experts`` file (moekit.train.expert_selection): per MoE layer each
expert's share of the summed gate weights (``gate``, the default), of the routed slots (``token``), or REAP's mean
gate weight x output norm (``reap``, when the file was written with ``--select-by reap``) on calibration data. The
pruned model keeps each layer's N best experts (ties: the lower id), in their original order, and drops the rest
with their router rows: the gate's row (and bias), the aux-loss-free ``expert_bias``, and every expert tensor's
row. Nothing else changes; top_k, the shared experts and the attention are the source's, so a token whose top_k
experts all survive is routed, weighted and computed as before (up to rounding: the GEMMs see other shapes) wherever
its gate weights depend on the chosen experts alone (softmax top-k renormalised over them, as Mixtral, Qwen3-MoE, OLMoE and gpt-oss route;
sigmoid scores, as DeepSeek-V3 and Llama 4, group-limited routing included). A softmax over all experts without
renormalisation (Switch, Qwen2-MoE) keeps the choice, and its weights grow by the share the dropped experts held.
Tokens that needed a dropped expert take their next choices instead. This is frequency-based pruning ("Not All Experts are Equal", 2024, and REAP, 2025, rank
experts by what calibration data routes to them; REAP also weighs each routed token by the expert's output norm).
On a load-balanced model the slot counts are nearly uniform and rank experts little better than chance; the gate
weights carried the most signal in docs/analysis.md's measurement, hence the default.

Group-limited routing (DeepSeek-V3's ``num_groups``) picks groups of consecutive experts, so each group keeps
N / num_groups of its own experts (N must be a multiple of it) and stays a group. A group is scored by its best
experts, so a group that lost one may score lower and hand its place to another: a token can then change groups
even though its own experts survived. Hash routing is refused: its
table sends token ids to fixed experts, whatever they are called. Every layer keeps the same N (the model has
one num_experts); the report gives the routing share each layer keeps.

OUT is a moekit model file (*.safetensors, *.pt) or a HuggingFace folder (its family's config with the new
expert count). ``--verify`` reloads OUT and compares its logits with the pruned model's.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moekit.moe.load import moe_layers
from moekit.train import UserError

CRITERIA = ("token", "gate", "reap")


def read_scores(path: str | Path, layers: dict[str, int], by: str) -> dict[str, list[float]]:
    """Each MoE layer's expert shares by ``by`` from a ``moekit-eval --select-experts`` file, checked against the
    model (``layers``: name -> experts) as the trainer checks a selection."""
    from moekit.train.expert_selection import read_selection

    read_selection(path, layers)  # the format, every layer, the expert counts: one line naming the file
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    out = {}
    for entry in record["layers"]:
        shares = entry.get(f"{by}_share")
        E = layers[entry["name"]]
        if (not isinstance(shares, list) or len(shares) != E
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in shares)):
            how = " --select-by reap" if by == "reap" else ""
            raise UserError(f"scores {path}: layer {entry['name']} has no {by}_share of {E} shares >= 0; write the "
                            f"file with moekit-eval SRC --data CALIB.bin --split all --select-experts {path}{how}")
        out[entry["name"]] = [float(v) for v in shares]
    return out


def kept_experts(shares: list[float], keep: int, groups: int = 1) -> list[int]:
    """The ``keep`` highest-share experts (ties: the lower id), sorted; with ``groups`` > 1, keep / groups of each
    block of len(shares) / groups consecutive experts."""
    E = len(shares)
    size = E // groups
    out = []
    for g in range(groups):
        ids = sorted(range(g * size, (g + 1) * size), key=lambda e: (-shares[e], e))
        out += ids[: keep // groups]
    return sorted(out)


def check_prunable(model, keep: int) -> int:
    """The routers' group count (1 without group-limited routing); a UserError for a model that cannot keep
    ``keep`` experts."""
    cfg = model.config
    E = cfg.num_experts
    if not E:
        raise UserError(f"{cfg.name}: a dense model has no experts to prune")
    if cfg.router == "hash":
        raise UserError("hash routing sends token ids to fixed experts; pruning would send them elsewhere: a hash-routed "
                        "model cannot be pruned")
    if not 1 <= keep < E:
        raise UserError(f"--keep {keep} is invalid; keep between 1 and {E - 1} of the model's {E} experts per layer")
    if keep < cfg.top_k:
        raise UserError(f"--keep {keep} is fewer than the {cfg.top_k} experts each token is routed to (top_k); keep at "
                        f"least {cfg.top_k}")
    groups = {getattr(layer.router, "num_groups", None) or 1 for _, layer in moe_layers(model)}
    g = max(groups)
    if g > 1 and keep % g:
        raise UserError(f"--keep {keep}: the router picks among {g} groups of consecutive experts, and each group keeps "
                        f"the same number of its own; use a multiple of {g}")
    group_top_k = getattr(next(layer for _, layer in moe_layers(model)).router, "group_top_k", None) or 0
    if g > 1 and keep // g * group_top_k < cfg.top_k:
        raise UserError(f"--keep {keep}: {keep // g} experts in each of the {group_top_k} groups a token may use are "
                        f"fewer than its top_k {cfg.top_k}; keep at least {-(-cfg.top_k // group_top_k) * g}")
    return g


@torch.no_grad()
def prune(model, kept: dict[str, list[int]]):
    """A new model (same class of config, ``num_experts`` = the kept count) holding ``model``'s weights with each MoE
    layer reduced to its ``kept`` experts (every router and expert tensor whose first dim is the expert count)."""
    import dataclasses

    from moekit.models.transformer import Transformer, meta_device

    cfg = model.config
    E = cfg.num_experts
    counts = {len(v) for v in kept.values()}
    assert len(counts) == 1, counts
    new_cfg = dataclasses.replace(cfg, num_experts=counts.pop())
    try:
        new_cfg.validate()
        with meta_device():
            pruned = Transformer(new_cfg)
    except ValueError as exc:
        raise UserError(f"the pruned model ({new_cfg.num_experts} experts) is not a valid {cfg.name}: {exc}") from None
    src = model.state_dict()
    rows = {}  # state-dict key -> the rows it keeps
    for name, layer in moe_layers(model):
        for part in ("router", "experts"):
            for key, t in getattr(layer, part).state_dict(keep_vars=True).items():
                if t is not None and t.dim() >= 1 and t.shape[0] == E:
                    rows[f"{name}.{part}.{key}"] = kept[name]
    state = {}  # the pruned model stays on the meta device until every tensor is assigned (no second full copy)
    for key, t in pruned.state_dict().items():
        if key not in src:
            raise RuntimeError(f"{key}: not in the source model")
        w = src[key][torch.tensor(rows[key])] if key in rows else src[key]
        if w.shape != t.shape:
            raise RuntimeError(f"{key}: {tuple(w.shape)} for {tuple(t.shape)}")
        state[key] = w.clone()  # the source's dtype (an HF checkpoint's bf16, a float32 expert_bias)
    pruned.load_state_dict(state, assign=True)
    for module in pruned.modules():  # non-persistent buffers (a router's pending load): zeros
        for bname, buf in module.named_buffers(recurse=False):
            if buf.is_meta:
                module.register_buffer(bname, torch.zeros_like(buf, device="cpu"), persistent=False)
    if hasattr(model, "hf_family"):  # an HF source's family: an HF OUT is written as it
        pruned.hf_family = model.hf_family
    return pruned.eval()


def _load(src: Path):
    """(model, the tokenizer folder it comes with or None) of SRC: a moekit model (file, checkpoint, run directory:
    its newest checkpoint that verifies) or an HF folder."""
    from moekit.train.inference import detect_kind
    from moekit.train.modelfiles import load_moekit, run_checkpoint, run_tokenizer

    if detect_kind(src) == "hf":
        from moekit.models.hf import load_hf

        return load_hf(src, dtype="auto"), src
    path = run_checkpoint(src)
    return load_moekit(path), run_tokenizer(path)


def prune_command(args) -> None:
    """moekit-convert prune: check flags and OUT, load, choose, prune, write (and with --verify, compare)."""
    from moekit.train.modelfiles import DTYPES, check_out, save_moekit, verify

    out, src = Path(args.out), Path(args.src)
    to_file = out.suffix in (".safetensors", ".pt")
    check_out(out, folder=not to_file)
    if not Path(args.scores).is_file():
        raise UserError(f"--scores {args.scores}: no such file (write it with moekit-eval {src} --data CALIB.bin "
                        f"--split all --select-experts {args.scores})")
    model, tokenizer = _load(src)
    groups = check_prunable(model, args.keep)
    layers = {name: layer.num_experts for name, layer in moe_layers(model)}
    shares = read_scores(args.scores, layers, args.by)
    kept = {name: kept_experts(s, args.keep, groups) for name, s in shares.items()}
    pruned = prune(model, kept)
    before, after = (sum(p.numel() for p in m.parameters()) for m in (model, pruned))
    held = {name: sum(shares[name][e] for e in kept[name]) for name in kept}
    worst = min(held, key=held.get)
    summary = (f"{model.config.num_experts} -> {args.keep} experts per MoE layer, {before / 1e6:.2f}M -> "
               f"{after / 1e6:.2f}M parameters; the kept experts held {min(held.values()):.1%} (at least, "
               f"{worst}) to {max(held.values()):.1%} of each layer's routing by {args.by} "
               f"(mean {sum(held.values()) / len(held):.1%})")
    if to_file:
        save_moekit(pruned, out)
        written = out
        print(f"wrote {out}: {summary}")
    else:
        from moekit.models.hf import save_hf
        from moekit.models.hf.export import check_tokenizer_source

        tokenizer = Path(args.tokenizer) if args.tokenizer else tokenizer
        if tokenizer:
            check_tokenizer_source(tokenizer, f"the tokenizer {tokenizer}", "--tokenizer")
        dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
        written = save_hf(pruned, out, family=args.family, dtype=dtype, tokenizer_from=tokenizer)
        print(f"wrote {written}: {summary}")
    for name in kept:
        print(f"  {name:<18} kept {100 * held[name]:5.1f}%: experts {' '.join(map(str, kept[name]))}")
    if args.verify:
        from moekit.models.hf import load_hf
        from moekit.train.modelfiles import load_moekit

        back = load_moekit(written) if to_file else load_hf(written, dtype="auto")
        verify(back, pruned.to(next(back.parameters()).dtype), f"prune -> {written}")
