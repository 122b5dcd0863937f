"""Op-level selective activation checkpointing with LoRA adapters (moe.recompute): an adapter adds only its r-wide
product x A^T to the cache, its expansion u B^T is recomputed, and the gradients are the uncheckpointed run's, on
every expert path (the CPU fused loop, grouped_mm, the per-expert loop)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from moekit.models.config import preset
from moekit.moe.recompute import marked, recomputed
from tests.test_dryrun import B, S, measure_one_process
from tests.test_lora_dropout import model_grads

PATHS = {"fused-loop": {}, "grouped": {"expert_backend": "torch"},
         "loop": {"expert_backend": "loop", "activation": "gelu"}}  # gelu: the loop's unfused per-expert path


@pytest.mark.parametrize("path", PATHS)
def test_selective_checkpointing_caches_an_adapter_its_r_wide_product_only(path):
    """Adapters on every projection add exactly r x 4 bytes per row they read to what selective checkpointing keeps:
    the attention's four (T rows each) and, where the dispatcher sees the experts' products, both sides of the routed
    experts (T x top_k rows; mixtral-tiny drops none). Before moe.recompute each also kept its [rows, out] expansion:
    +40% (fused loop) to +75% (grouped) over the model without adapters, against +1.6% / +1.4% now."""
    r = 4
    cfg = dataclasses.replace(preset("mixtral-tiny"), num_layers=2, **PATHS[path])
    plain = measure_one_process(cfg, "selective", backward=False)["activations"]
    adapted = measure_one_process(dataclasses.replace(cfg, lora_rank=r, lora_targets="all"), "selective",
                                  backward=False)["activations"]
    T = B * S
    expert_rows = 0 if path == "fused-loop" else 2 * T * cfg.top_k  # the fused loop is recomputed whole
    assert adapted - plain == cfg.num_layers * (4 * T + expert_rows) * r * 4


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_selective_checkpointing_with_adapters_gives_the_uncheckpointed_gradients(path, dropout):
    """Trained adapters (B != 0) so every product reaches the loss; the recomputed expansions feed the same sums."""
    cfg = dataclasses.replace(preset("mixtral-tiny"), num_layers=2, lora_rank=4, lora_dropout=dropout, **PATHS[path])
    seed = random.randrange(1 << 20)
    loss, grads = model_grads(cfg, "none", seed)
    sel_loss, sel_grads = model_grads(cfg, "selective", seed)
    assert sel_loss == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == sel_grads.keys() and any(".lora_a" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(sel_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_the_mark_covers_the_call_only_and_nests():
    seen = []
    assert not marked()
    assert recomputed(lambda: recomputed(lambda: seen.append(marked())) or marked()) is True
    assert seen == [True] and not marked()
    with pytest.raises(ZeroDivisionError):
        recomputed(lambda: 1 / 0)
    assert not marked()  # cleared on the way out of an error too


def test_compiled_graphs_name_low_rank_expansions_by_shape():
    """In compiled code (no mark) a matmul at most LOW_RANK deep into an output at least twice as wide is an
    expansion: recomputed, not kept by copy; projections (K = the input width) and wide ranks are kept."""
    from moekit.models.parallelize import LOW_RANK, _low_rank_expansion

    def mm(m, k, n, bias=False):
        return ((torch.empty(m, n),) if bias else ()) + (torch.empty(m, k), torch.empty(k, n))

    assert _low_rank_expansion(mm(64, 8, 4096, bias=True))  # LoRALinear's addmm(y, u, B^T), r 8
    assert _low_rank_expansion(mm(64, LOW_RANK, 2 * LOW_RANK))
    assert not _low_rank_expansion(mm(64, 4096, 8))  # x A^T: deep, narrow
    assert not _low_rank_expansion(mm(64, 1536, 24576))  # MLA's q up-projection: a latent rank in the hundreds
    assert not _low_rank_expansion(mm(64, 2 * LOW_RANK, 4096))  # rank 32: kept by copy
    assert not _low_rank_expansion(mm(64, 16, 16))  # as wide as deep: not an expansion
    assert not _low_rank_expansion((torch.empty(3),))
