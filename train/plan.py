"""What one run derives from its configuration before building anything: device, dtype, micro-batching,
memory check (Plan); the learning-rate schedule; the optimizer."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from moekit.models.stats import model_stats
from moekit.train import UserError
from moekit.train.cli import pipeline_microbatches
from moekit.train.config import TrainConfig

BYTES_PER_PARAM = 16  # fp32 weights + gradients + AdamW's two moments


@dataclass
class Plan:
    """Derived quantities, resolved once."""

    device: torch.device
    autocast_dtype: torch.dtype | None  # None = plain fp32
    micro_batch: int
    accum: int
    per_rank: int
    tokens_per_step: int
    flops_per_token: float


def make_plan(cfg: TrainConfig) -> Plan:
    t = cfg.train
    want = t.device if t.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("--train.device=cuda but torch sees no CUDA device; use --train.device cpu")
    device = torch.device(want)
    dtype = {"float32": None, "bfloat16": torch.bfloat16, "auto": torch.bfloat16 if want == "cuda" else None}[t.dtype]
    D = cfg.layout.dp * cfg.layout.fsdp  # data-parallel ranks, each reading its share of the batch
    per_rank = t.batch_size // D
    micro = t.micro_batch_size or per_rank
    if cfg.layout.pp > 1:  # the pipeline's micro-batches are the accumulation (cli.check_pipeline checked them)
        micro = per_rank // pipeline_microbatches(cfg)
    if t.batch_size % D or per_rank % micro:
        raise UserError(f"--batch-size {t.batch_size} must split into {D} data-parallel shares of whole "
                        f"micro-batches of {micro} (--train.micro_batch_size)")
    stats = model_stats(cfg.model, t.seq_len)
    L = cfg.layout  # experts dominate (EP and FSDP shard them); TP and FSDP shard the rest
    need = stats.params * BYTES_PER_PARAM / max(L.ep * L.fsdp, L.tp * L.fsdp, 1) / L.pp
    have = (torch.cuda.mem_get_info(device)[1] if want == "cuda"
            else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    if need > have:
        raise UserError(f"{cfg.preset}: {stats.params / 1e9:.1f}B parameters need ~{need / 2**30:,.0f} GiB for fp32 "
                        f"weights, gradients and AdamW state; this {want} has {have / 2**30:,.0f} GiB. Use a tiny "
                        f"preset (mixtral-tiny, switch-tiny, deepseek-tiny) or wait for multi-rank training")
    return Plan(device, dtype, micro, per_rank // micro, per_rank, t.batch_size * t.seq_len,
                stats.train_flops_per_token)


def lr_lambda(cfg: TrainConfig):
    """Linear warmup to 1, then cosine to min_lr_ratio at the last step (multiplies train.lr)."""
    t = cfg.train

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min((step - t.warmup_steps) / max(t.steps - t.warmup_steps, 1), 1.0)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def make_optimizer(model: Transformer, cfg: TrainConfig) -> torch.optim.AdamW:
    t = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices, expert stacks, embeddings
    rest = [p for p in model.parameters() if p.dim() < 2]  # norm scales
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    # foreach=False: the per-parameter loop is what the CPU reference runs; bitwise resume relies on
    # the same kernels before and after a restart either way.
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False)
