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


def test_resume_keeps_this_runs_adamw_implementation_whatever_wrote_the_checkpoint():
    """torch's load_state_dict copies the saved groups' 'fused' / 'foreach' flags: a checkpoint written on a
    GPU (fused) would make a CPU resume fused, and a CPU one would make a GPU resume foreach. The trainer's
    resume (train.resume.apply_optimizer_settings) puts this run's implementation back; the moments stay."""
    from moekit.train import resume

    model, cfg = _model_and_cfg(0)
    sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # noqa: E731

    def fused_like_a_gpu_run():  # the trainer's groups, AdamW fused (what make_optimizer builds on a GPU)
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in make_optimizer(model, cfg).param_groups]
        return torch.optim.AdamW(groups, lr=cfg.train.lr, fused=True)

    written = fused_like_a_gpu_run()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    written.step()
    saved = written.state_dict()
    assert all(g["fused"] for g in saved["param_groups"])

    run = make_optimizer(model, cfg)  # this run: CPU, foreach
    fresh = resume.optimizer_settings(run)
    run.load_state_dict(saved)
    assert all(g["fused"] for g in run.param_groups)  # what torch alone would leave
    resume.apply_optimizer_settings(run, sched(run), fresh)
    assert all(g["foreach"] is True and not g["fused"] for g in run.param_groups)
    moments = [run.state[p]["exp_avg"] for p in model.parameters()]
    assert all(m.abs().sum() > 0 for m in moments)  # the restored moments stay
    run.step()  # and the foreach step runs on them

    # the other way: a foreach checkpoint into a fused run keeps fused, step counts on the parameters' device
    fused_run = fused_like_a_gpu_run()
    fresh = resume.optimizer_settings(fused_run)
    fused_run.load_state_dict(run.state_dict())
    resume.apply_optimizer_settings(fused_run, sched(fused_run), fresh)
    assert all(g["fused"] is True for g in fused_run.param_groups)
    assert all(fused_run.state[p]["step"].device == p.device for p in model.parameters())
    fused_run.step()
