"""The dispatch cost model against a Monte Carlo count of the same routing (no processes needed)."""
import random

import pytest

from moekit.train.planning import cost_model


def simulate(N, G, E, k, M=None, tokens=20000, seed=0):
    rng = random.Random(seed)
    per_node, per_rank = E // N, E // (N * G)
    me_node, me_pos = 0, 0
    flat_inter = flat_intra = hier_inter = hier_intra = 0
    for _ in range(tokens):
        nodes = rng.sample(range(N), M) if M else list(range(N))
        experts = rng.sample([e for n in nodes for e in range(n * per_node, (n + 1) * per_node)], k)
        ranks = {e // per_rank for e in experts}  # global rank index = node * G + position
        for e in experts:
            node, pos = divmod(e // per_rank, G)
            flat_inter += node != me_node
            flat_intra += node == me_node and pos != me_pos
        visited = {r // G for r in ranks}
        hier_inter += len(visited - {me_node})
        for e in experts:  # the row lands on the rank at my position on its node, then one row per slot
            hier_intra += (e // per_rank) % G != me_pos
    t = float(tokens)
    return (flat_inter / t, flat_intra / t), (hier_inter / t, hier_intra / t)


@pytest.mark.parametrize("N,G,E,k,M", [(2, 2, 16, 3, None), (4, 2, 32, 8, None), (8, 4, 256, 8, None),
                                       (8, 4, 256, 8, 4), (4, 4, 64, 6, 2)])
def test_cost_model_matches_simulation(N, G, E, k, M):
    (fi, fa), (hi, ha) = simulate(N, G, E, k, M)
    f = cost_model.flat(N, G, E, k, M)
    h = cost_model.hierarchical(N, G, E, k, M)
    assert f.inter_rows == pytest.approx(fi, rel=0.03) and f.intra_rows == pytest.approx(fa, rel=0.05, abs=0.01)
    assert h.inter_rows == pytest.approx(hi, rel=0.03) and h.intra_rows == pytest.approx(ha, rel=0.05, abs=0.01)
    assert h.inter_rows <= f.inter_rows + 1e-9  # dedup never costs inter-node bytes
