"""What a training run says at its start and at its end (moekit.train.trainer.Trainer.describe / finish): the
opening lines (model, data, device and batch, layout, the options in force, resume notes) and the closing ``done:``
line, printed by rank 0 through the run's monitor."""
from __future__ import annotations

import torch

from moekit.models.stats import model_stats
from moekit.train import ema, records
from moekit.train.data import unigram_entropy


def describe(trainer) -> None:
    """The run's opening lines on rank 0: model, data, device and batch, layout, the options in force, resume notes."""
    if not trainer.dist.is_main:
        return
    cfg, plan = trainer.cfg, trainer.plan
    stats = model_stats(cfg.model, cfg.train.seq_len)
    say = trainer.monitor.print
    say(f"model {cfg.model.name if cfg.source_note else cfg.preset}: {stats.params / 1e6:.2f}M parameters, {stats.active_params / 1e6:.2f}M active, "
        f"{stats.train_flops_per_token / 1e6:.1f} MFLOP/token; router {cfg.model.router}, "
        f"{cfg.model.num_moe_layers} MoE layers x {cfg.model.num_experts} experts")
    if getattr(cfg, "source_note", None) and not trainer.resume_from:
        say(cfg.source_note)
    if trainer.init_from is not None:
        ckpt, meta = trainer.init_from
        origin = "the model file" if meta.get("file") else f"step {meta.get('step', '?')} of its run"
        say(f"weights from {ckpt} ({origin}); a fresh optimizer, LR schedule and data order")
    if cfg.train.init_from_dense and not trainer.resume_from:
        drop = (f"; drop-upcycling: {cfg.train.upcycle_drop:g} of each expert's units re-initialised"
                if cfg.train.upcycle_drop else "")
        say(f"upcycled from the dense model {cfg.train.init_from_dense} (granularity {cfg.train.upcycle_granularity}"
            f"{drop})")
    t = cfg.train
    if t.warmup_steps >= t.steps and t.lr_schedule != "cosine":  # the default's short test runs stay quiet
        say(f"note: --train.warmup_steps {t.warmup_steps} >= --steps {t.steps}: the whole run warms up, so "
            f"--train.lr_schedule {t.lr_schedule} never applies; lower --train.warmup_steps")
    ignored = cfg.model.unused_router_fields()
    for name in ignored:
        say(f"note: router {cfg.model.router!r} takes no {name}; model.{name}={getattr(cfg.model, name)!r} is unused")
    say(f"data: {trainer.data_desc}; {trainer.split.train_starts.size:,} train / {trainer.split.val_starts.size:,} "
        f"validation sequences of {cfg.train.seq_len}")
    if trainer.tasks is not None:
        say(f"tasks at each evaluation: {trainer.tasks.describe()}")
    if trainer.split.mask is not None and not cfg.data.document_mask and trainer.data.tokenizer.eos_id is not None:
        say("note: the data has loss masks (conversations) and --data.document_mask is off: each conversation in a "
            "window attends to the ones before it; --data.document_mask true keeps every conversation to itself")
    resid = ("" if plan.residual_dtype is None
             else f" ({str(plan.residual_dtype).removeprefix('torch.')} residual stream)")
    say(f"device {plan.device}, {plan.autocast_dtype or torch.float32}{resid}; batch {cfg.train.batch_size} x "
        f"{cfg.train.seq_len} tokens ({plan.accum} micro-batch(es) of {plan.micro_batch}); run dir {trainer.run_dir}; "
        f"{trainer.monitor.describe()}")
    if cfg.train.batch_size_start:
        t = cfg.train
        first = plan.step_batch(t, 1)
        say(f"batch-size ramp: {first.size} sequences at step 1 ({first.accum} micro-batch(es) of "
            f"{first.micro_batch} per rank), {t.batch_size} from step {t.batch_ramp_steps + 1}")
    scaled = [g for g in trainer.optimizer.param_groups if "lr_scale" in g]  # --train.lr_scale
    if scaled:
        by = {}
        for g in scaled:
            by[g["lr_scale"]] = by.get(g["lr_scale"], 0) + sum(p.numel() for p in g["params"])
        say("learning-rate multipliers (--train.lr_scale): " + ", ".join(
            f"x{f:g} on {n / 1e6:.2f}M parameters (this rank's shards)" for f, n in sorted(by.items())))
    if trainer.freeze is not None:  # --train.trainable / freeze / train_experts (moekit.train.freezing)
        say(trainer.freeze.describe())
        m = cfg.model
        aux = m.aux_loss_coeff > 0 and "aux_loss_coeff" not in m.unused_router_fields()
        if trainer.freeze.routers_frozen and aux:
            say(f"note: every router is frozen, but the load-balancing loss (--model.aux_loss_coeff "
                f"{m.aux_loss_coeff:g}) still trains the layers before them, the only way left to lower it; "
                f"--model.aux_loss_coeff 0 drops it")
    if cfg.train.host_memory != "system":
        say(trainer.host_memory)
    if trainer.dist.active:
        L = cfg.layout
        degrees = " ".join(f"{k}={getattr(L, k)}" for k in ("pp", "dp", "fsdp", "cp", "tp", "ep") if getattr(L, k) > 1)
        say(f"layout: {trainer.dist.world} ranks, {degrees} (experts {cfg.model.num_experts // L.ep} per rank), "
            f"{trainer.dist.topology.num_nodes} node(s) of {trainer.dist.topology.ranks_per_node} ranks")
    if trainer.pipe is not None:
        stages = " | ".join(f"{r.start}-{r.stop - 1}" for r in trainer.pipe.ranges)
        say(f"pipeline: {cfg.layout.pp_schedule}, {len(trainer.pipe.ranges)} stages (layers {stages}), "
            f"{plan.accum} micro-batches of {plan.micro_batch} per step")
    if trainer.placement.describe():
        say(trainer.placement.describe())
    if trainer.start_step:
        say(f"resumed from {trainer.resume_from} at step {trainer.start_step}")
    if trainer.start_step >= cfg.train.steps:  # a finished run restarted (a scheduler's retry): nothing to do
        say(f"note: nothing to train: the checkpoint is at step {trainer.start_step} and --steps is "
            f"{cfg.train.steps}; raise --steps to train further")
    if trainer.changes.summary():
        say(trainer.changes.summary())
    saved_ema = (trainer.resumed_run or {}).get(ema.RUN_KEY) if trainer.start_step else None
    if trainer.ema is not None:
        say(ema.describe(t.ema_decay, t.ema_every, t.ema_start)
            + (" (not measured: --eval.ema false)" if not cfg.eval.ema else ""))
        if saved_ema and not trainer.ema.started:
            say(f"note: the checkpoint's parameter EMA did not load; it starts afresh at step {trainer.start_step + 1}")
        elif trainer.start_step and not saved_ema and trainer.start_step >= t.ema_start:
            say("note: the checkpoint holds no parameter EMA; it starts at the resumed weights")
    elif saved_ema:
        say("note: the checkpoint's parameter EMA is dropped (this run has no --train.ema_decay)")
    if cfg.profile.every:
        from moekit.train.profiling import plan_note

        say(plan_note(cfg.profile, trainer.start_step, cfg.train.steps, trainer.run_dir))


def finish(trainer) -> None:
    """The run's closing line on rank 0 (``done: ...``), from its metrics.jsonl."""
    every = records.read_metrics(trainer.run_dir)
    rows = [r for r in every if not r.get("skipped")]
    if not rows and not every:  # a run resumed at its last step (e.g. to export): nothing trained, nothing logged
        trainer.monitor.print(f"done: nothing to train (the checkpoint is at step {trainer.start_step}, --steps "
                           f"{trainer.cfg.train.steps})")
        return
    if not rows:
        trainer.monitor.print(f"done: every step was skipped (non-finite or spikes); see "
                           f"{trainer.run_dir / records.METRICS}")
        return
    final = rows[-1]
    entropy = unigram_entropy(trainer.split.tokens[: 1 << 22], trainer.cfg.model.vocab_size)
    skipped = [r for r in every if r.get("skipped")]
    spiked = sum(1 for r in skipped if r.get("spike"))
    note = (f" Skipped {len(skipped)} step(s) ({spiked} spike(s), {len(skipped) - spiked} non-finite): "
            f"\"skipped\" lines of {records.METRICS}." if skipped else "")
    averaged = f" (EMA {final['val_loss_ema']:.4f})" if "val_loss_ema" in final else ""
    trainer.monitor.print(f"done: step {final['step']}, loss {final['loss']:.4f}, val_loss "
                       f"{final.get('val_loss', float('nan')):.4f}{averaged} (unigram entropy of the data "
                       f"{entropy:.4f}), {final['elapsed_s']:.0f}s.{note} Expert load: moekit-heatmap "
                       f"{trainer.run_dir}")
