"""Plan an expert placement from a run's recorded expert load: ``moekit-placement`` (``python tools/placement.py``).

    moekit-placement RUN_DIR --ep N [--ranks-per-node G] [--replicas R] [--steps FIRST:LAST] [-o placement.json]
    moekit-placement RUN_DIR --check placement.json [--ranks-per-node G] [--steps FIRST:LAST]

reads RUN_DIR's expert-load record (moekit.train.records) over the steps, packs every MoE layer's experts
onto N expert-parallel ranks (comm.placement.plan_placement: balanced, node-aware when G < N, the hottest
experts replicated into R extra slots), prints on the recorded steps the max/mean tokens per rank of the
contiguous placement and of the plan, and the predicted dispatch traffic of both (the cost model of
moekit.train.planning.cost_model, weighted by the recorded load), and writes the placement file that
``moekit-train --layout.expert_placement FILE`` runs with. ``--check FILE`` plans nothing: it scores FILE's
placement on the steps (e.g. steps after those it was planned from: how well a plan holds up).

--ranks-per-node counts the ranks of one EP group on a node (torchrun's ranks per node / tp with tensor
parallelism). Exit status: 0 done, 2 bad input.

Traffic model (per token, per MoE layer, dispatch direction; combine moves the same back): a token's k slots
pick experts with the recorded shares p_e, each slot the copy its source rank uses (comm.placement's route
table), so node j receives the share Q_j of a source's slots and rank r the share q_r:
    flat          inter rows = k (1 - Q_own)        intra rows = k (Q_own - q_self)
    hierarchical  inter rows = sum over other nodes j of P(j visited) = 1 - prod_{t<k} (1 - Q_j - t/E) / (1 - t/E)
                  intra rows = k sum_j (Q_j - q_peer(j))   (peer(j): the rank at the source's position on node j)
With uniform shares and contiguous blocks these are exactly cost_model.flat and cost_model.hierarchical.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from moekit.comm.placement import Placement, imbalance, plan_placement, save_placements
from moekit.train import OneLineParser, UserError, program_name, run_program
from moekit.train.planning.cost_model import ExpectedRows
from moekit.train.runlock import probe_writable

PROG = program_name("placement.py")


def node_list(ep: int, ranks_per_node: int | None) -> tuple[int, ...] | None:
    """The node of each EP position (positions are node-major), None for one node."""
    if not ranks_per_node or ranks_per_node >= ep:
        return None
    return tuple(p // ranks_per_node for p in range(ep))


def expected_rows(placement: Placement, counts, top_k: int, ranks_per_node: int | None = None
                  ) -> tuple[ExpectedRows, ExpectedRows]:
    """(flat, hierarchical) expected dispatch rows per token of one layer under ``placement`` when tokens
    pick experts with the shares of ``counts`` [E] (module docstring), averaged over source ranks."""
    P, S, E, k = placement.ep, placement.slots_per_rank, placement.num_experts, top_k
    nodes = node_list(P, ranks_per_node)
    G = P if nodes is None else ranks_per_node
    m = P // G
    share = np.asarray(counts, dtype=np.float64)
    share = share / share.sum() if share.sum() > 0 else np.full(E, 1.0 / E)
    flat, hier = np.zeros(2), np.zeros(2)  # (inter, intra)
    for i in range(P):
        q = np.zeros(P * S)
        for e, copies in enumerate(placement.route_table(i, nodes)):
            q[copies] += share[e] / len(copies)
        q_rank = q.reshape(P, S).sum(1)  # [P]
        Q = q_rank.reshape(m, G).sum(1)  # [m]
        own = i // G
        flat += (k * (1 - Q[own]), k * (Q[own] - q_rank[i]))
        for j in range(m):
            hier[1] += k * (Q[j] - q_rank[j * G + i % G])
            if j != own:
                hier[0] += 1 - np.prod([max(0.0, 1 - Q[j] - t / E) / (1 - t / E) for t in range(k)])
    return ExpectedRows(*(flat / P)), ExpectedRows(*(hier / P))


def recorded_load(run_dir: str, steps: str | None):
    """(layer names, top_k, step numbers [N], tokens [N, L, E] int64) of the record's window."""
    from moekit.train.records import parse_window, read_expert_load

    rec = read_expert_load(run_dir)
    lo, hi = parse_window(steps)
    chosen = np.ones(len(rec.steps), dtype=bool)
    if lo is not None:
        chosen &= rec.steps >= lo
    if hi is not None:
        chosen &= rec.steps <= hi
    if not chosen.any():
        raise UserError(f"--steps {steps}: no expert-load records there (the run has steps {int(rec.steps.min())}.."
                        f"{int(rec.steps.max())})")
    index = np.flatnonzero(chosen)
    return list(rec.layers), int(rec.top_k), np.asarray(rec.steps)[index], np.asarray(rec.tokens[index], dtype=np.int64)


def evaluate(placements: list[Placement], tokens: np.ndarray, top_k: int, ranks_per_node: int | None) -> dict:
    """Per layer: mean over steps of max/mean tokens per rank, and the expected rows per token."""
    nodes = node_list(placements[0].ep, ranks_per_node)
    out = {"imbalance": [], "flat": [], "hierarchical": []}
    for layer, p in enumerate(placements):
        per_step = p.rank_loads(tokens[:, layer], nodes)  # [N, P]
        out["imbalance"].append(float(imbalance(per_step).mean()))
        flat, hier = expected_rows(p, tokens[:, layer].sum(0), top_k, ranks_per_node)
        out["flat"].append(flat)
        out["hierarchical"].append(hier)
    return out


def _rows(items: list[ExpectedRows], which: str) -> float:
    return float(np.mean([getattr(r, which) for r in items]))


def report(names, before: dict, after: dict, hidden: int, elem: int, multi_node: bool) -> list[str]:
    lines = [f"{'max/mean tokens per rank, mean over steps':<44} {'contiguous':>10} {'placed':>9}"]
    for i, name in enumerate(names):
        lines.append(f"  {name:<42} {before['imbalance'][i]:>10.3f} {after['imbalance'][i]:>9.3f}")
    lines.append(f"  {'all layers: mean':<42} {np.mean(before['imbalance']):>10.3f} {np.mean(after['imbalance']):>9.3f}")
    lines.append(f"  {'all layers: worst':<42} {max(before['imbalance']):>10.3f} {max(after['imbalance']):>9.3f}")
    row = hidden * elem
    lines.append(f"{'dispatch per token and MoE layer (rows; KB at H=' + str(hidden) + ', ' + str(elem) + ' B)':<44} "
                 f"{'contiguous':>10} {'placed':>9} {'change':>8}")
    kinds = [("flat", "inter_rows", "flat inter-node"), ("hierarchical", "inter_rows", "hierarchical inter-node"),
             ("flat", "intra_rows", "flat intra-node"), ("hierarchical", "intra_rows", "hierarchical intra-node")]
    for algo, which, label in kinds:
        if not multi_node and (algo == "hierarchical" or which == "inter_rows"):
            continue
        a, b = _rows(before[algo], which), _rows(after[algo], which)
        change = f"{(b - a) / a:+.1%}".replace("-0.0%", "+0.0%") if a > 0 else "-"
        lines.append(f"  {label:<28} rows {a:>6.3f} -> {b:<6.3f} KB {a * row / 1e3:>7.3f} -> {b * row / 1e3:<7.3f} {change:>8}")
    return lines


def checked(path: str, names: list[str], ep: int | None, E: int) -> tuple[list[Placement], int, int]:
    """(placements in the record's layer order, ep, replicas) of the placement file ``path`` (--check)."""
    from moekit.comm.placement import load_placements

    try:
        found, _ = load_placements(path)
    except ValueError as exc:
        raise UserError(f"--check {exc}") from None
    if set(found) != set(names):
        raise UserError(f"--check {path}: places layers {sorted(found)}, the run has {names}")
    first = found[names[0]]
    if first.num_experts != E:
        raise UserError(f"--check {path}: places {first.num_experts} experts, the run has {E}")
    if ep is not None and ep != first.ep:
        raise UserError(f"--check {path}: a placement for ep={first.ep}, not --ep {ep}")
    return [found[n] for n in names], first.ep, first.replicas


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, allow_abbrev=False, description="Plan a load-balanced expert placement from a "
                      "run's recorded expert load (for moekit-train --layout.expert_placement).")
    p.add_argument("run_dir", help="a moekit-train run directory (its expert-load record and config.json)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks to place the experts on")
    p.add_argument("--check", default=None, metavar="FILE", help="score this placement file instead of planning one")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="EP ranks per node (default: all on one node); with tp > 1, ranks per node / tp")
    p.add_argument("--replicas", type=int, default=0, help="redundant expert slots over the EP group (multiple of --ep)")
    p.add_argument("--steps", default=None, help="FIRST:LAST recorded steps to plan from (default: all)")
    p.add_argument("--bytes-per-elem", type=int, default=2, help="bytes per hidden element sent (2: bf16)")
    p.add_argument("-o", "--out", default="placement.json", help="placement file to write (default placement.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 2 bad input (flags, a run without load records, a placement that does not fit), one
    line on stderr."""
    return run_program(PROG, lambda: run(build_parser().parse_args(sys.argv[1:] if argv is None else argv)))


def check_flags(args) -> None:
    """The flags' own values, before any record is read."""
    for flag, value in (("--ep", args.ep), ("--ranks-per-node", args.ranks_per_node),
                        ("--bytes-per-elem", args.bytes_per_elem)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value} is invalid; it must be a positive integer")
    if args.replicas < 0:
        raise UserError(f"--replicas {args.replicas} is invalid; it must be >= 0 (a multiple of --ep)")
    if not args.check:  # the placement file to write: checked now, not after the planning
        out = Path(args.out)
        if out.is_dir():
            raise UserError(f"-o/--out {out}: a directory; name the placement file, e.g. {out / 'placement.json'}")
        probe_writable(out.parent, "-o/--out", keep=True)


def run(args) -> int:
    from moekit.train.records import read_config

    check_flags(args)
    names, top_k, steps, tokens = recorded_load(args.run_dir, args.steps)
    config = read_config(args.run_dir)
    model = config.get("model", {})
    if args.check:
        planned, args.ep, args.replicas = checked(args.check, names, args.ep, tokens.shape[2])
    if args.ep is None:
        raise UserError("--ep N is required: the expert-parallel ranks to place the experts on (or --check FILE)")
    G = args.ranks_per_node
    if G is not None and (G < 1 or args.ep % G):
        raise UserError(f"--ranks-per-node {G} must divide --ep {args.ep} (the EP group spans whole nodes)")
    if not args.check:
        try:
            planned = plan_placement(tokens, args.ep, G, args.replicas,
                                     (model.get("router_options") or {}).get("num_groups"))
        except ValueError as exc:
            raise UserError(str(exc)) from None
    E = tokens.shape[2]
    before = evaluate([Placement.contiguous(E, args.ep)] * len(names), tokens, top_k, G)
    after = evaluate(planned, tokens, top_k, G)
    multi = node_list(args.ep, G) is not None
    nodes = f"{args.ep // G} nodes x {G} ranks" if multi else "one node"
    print(f"run {args.run_dir}: {len(names)} MoE layers x {E} experts, top-{top_k}, steps {int(steps[0])}-"
          f"{int(steps[-1])} ({len(steps)} recorded)")
    what = f"{args.check} (checked)" if args.check else "planned"
    print(f"placement {what}: ep {args.ep} ({nodes}), {planned[0].slots_per_rank} slots per rank, {args.replicas} "
          f"redundant")
    for line in report(names, before, after, int(model.get("hidden_size", 0)), args.bytes_per_elem, multi):
        print(line)
    if args.check:
        return 0
    predicted = {"imbalance_contiguous": float(np.mean(before["imbalance"])),
                 "imbalance_planned": float(np.mean(after["imbalance"])),
                 "inter_rows_per_token": {algo: [_rows(before[algo], "inter_rows"), _rows(after[algo], "inter_rows")]
                                          for algo in ("flat", "hierarchical")}}
    save_placements(args.out, dict(zip(names, planned)), ranks_per_node=G, replicas=args.replicas,
                    planned_from={"run_dir": str(args.run_dir), "steps": [int(steps[0]), int(steps[-1])]},
                    predicted=predicted)
    print(f"wrote {args.out}: moekit-train ... --ep {args.ep} --layout.expert_placement {args.out}")
    return 0
