"""train.plan.make_optimizer: parameter groups and the AdamW implementation chosen per device.

On CPU the trainer uses foreach (rounds like the per-parameter loop, so layouts agree); on a GPU the fused
kernel (tests/test_gpu.py checks that path on CUDA). Here: the groups are right and the fused kernel, run on
CPU with the same groups, moves the weights as foreach does to float rounding (so switching the GPU path
to fused changes the training numbers by rounding only).
"""
from __future__ import annotations

import os

import torch

from moekit.models.transformer import build_model
from moekit.train.config import new_config
from moekit.train.plan import make_optimizer


def _model_and_cfg(seed: int):
    cfg = new_config("mixtral-tiny")
    cfg.train.weight_decay = 0.1
    cfg.train.lr = 1e-2
    torch.manual_seed(seed)
    return build_model(cfg.model, torch.device("cpu")), cfg


def test_cpu_optimizer_is_foreach_with_decay_on_matrices_only():
    model, cfg = _model_and_cfg(0)
    opt = make_optimizer(model, cfg)
    assert opt.defaults["foreach"] is True and not opt.defaults.get("fused")
    decay, rest = opt.param_groups
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in rest["params"])
    assert len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))


def test_fused_adamw_on_the_trainers_groups_matches_foreach():
    seed = int(os.environ.get("MOEKIT_TEST_SEED", "0"))
    model_a, cfg = _model_and_cfg(seed)
    model_b, _ = _model_and_cfg(seed)
    opt_a = make_optimizer(model_a, cfg)
    opt_b = torch.optim.AdamW(
        [{**g, "params": [dict(model_b.named_parameters())[n] for n, p in model_a.named_parameters()
                          if any(p is q for q in g["params"])]} for g in opt_a.param_groups],
        lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), eps=cfg.train.eps, fused=True)
    start = [p.detach().clone() for p in model_a.parameters()]
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17))
    for _ in range(3):
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    moved = max((pa - p0).abs().max().item() for pa, p0 in zip(model_a.parameters(), start))
    assert moved > 1e-3  # three steps of lr 1e-2: the comparison below is not between untouched weights
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-5, msg=name)
