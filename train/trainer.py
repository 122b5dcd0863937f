"""The training run (``moekit-train``'s ``Trainer``; its entry point, flags and error reporting are
moekit.train.loop): set up (data, model, optimizer, run dir, resume), then the step loop.

One optimizer step:
    1. the sampler yields the global batch (batch_size windows); this rank takes its contiguous share
    2. micro-batches: forward, cross-entropy / accum, backward (router aux losses join backward
       inside each MoELayer, scaled once by moe.layer.set_aux_loss_scale); under pipeline
       parallelism the schedule runs them (models.pipeline.Pipeline.step)
    3. non-finite loss or gradient norm: stop *before* the optimizer step (checkpoints stay good)
    4. clip, AdamW step, LR schedule step, aux-loss-free router bias update
    5. records: metrics.jsonl, expert_load.jsonl, console; then eval / checkpoint when due
    6. a SIGTERM / SIGINT on any rank (agreed on in step 3's all-reduce): save, exit 128 + signal
"""
from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moekit.comm.context_parallel import set_attribute
from moekit.models.init import init_weights
from moekit.models.transformer import Transformer, meta_device
from moekit.moe import collect_load, update_router_biases
from moekit.moe.layer import set_aux_loss_scale
from moekit.train import (UserError, checkpoint, faults, hfrun, host_memory, program_name, records, resume,
                          ema, freezing, grad_parts, rundir, run_lines, runlock, spikes, stalls)
from moekit.train.cli import Options
from moekit.train.plan import StepBatch, lr_lambda, make_optimizer, plan_run
from moekit.train.rebalance import RunPlacement
from moekit.train.config import TrainConfig, excluded
from moekit.train.consistency import check_ranks_agree
from moekit.train.distributed import Dist
from moekit.train.faults import RunFailed
from moekit.train.guard import Guard, NonFinite, set_deterministic
from moekit.models.loss import IGNORE_INDEX
from moekit.train.data import Split, gather, load_data
from moekit.train.data import counted as counted_targets_of
from moekit.train.tokens import record_tokenizer
from moekit.train.monitor import Monitor, peak_flops, peak_memory_gb

PROG = program_name("train.py")  # moekit-train when started as the console script


def _warn(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


class Trainer:
    def __init__(self, cfg: TrainConfig, opts: Options):
        self.cfg, self.opts = cfg, opts
        self.plan = plan_run(cfg)  # resolves the layout and the batch split (moekit.train.plan)
        self.restore_determinism = set_deterministic(cfg.train.deterministic, self.plan.device)
        self.host_memory = host_memory.configure(cfg.train.host_memory)
        L = cfg.layout
        self.dist = Dist.setup(self.plan.resolved.layout, cfg.model.num_experts, self.plan.device,
                               L.ranks_per_node or None, L.timeout_s)
        self.data, error = None, None
        self.profiler = None  # [profile] (moekit.train.profiling), set up once the model is built
        self.watch = stalls.StallWatch(None, 0, 0.0, enabled=False)  # train() starts this rank's (moekit.train.stalls)
        try:  # moekit.train.data: a token file (its metadata: vocab, tokenizer), a blend, text, the embedded corpus
            self.data = load_data(cfg.data, cfg.model.vocab_size)
            self.data_desc = self.data.desc
            self.document_eos = document_eos(cfg, self.data)
        except UserError as exc:  # raised below, on every rank alike
            error = exc
        # every rank: the same settings, software and data, or one line naming what differs (collective)
        sources = [] if self.data is None else [*self.data.sources, *([self.data.val] if self.data.val else [])]
        # the tokens of every set (--data.val_path's too) and their loss masks
        files = None if self.data is None else [a for s in sources for a in (s.tokens, s.mask) if a is not None]
        check_ranks_agree(cfg.to_dict(), files, error)
        # rank 0 locks the run dir, refuses an earlier run's, probes what it writes; before anything is touched
        self.run_lock = self.dist.from_main(lambda: rundir.claim(cfg, opts.resume is not None or opts.overwrite, _warn))
        self.split: Split = self.data.split(cfg.train.seq_len, cfg.data.val_fraction)
        self.run_dir = Path(cfg.run_dir)
        # verified (sizes, sha256, model config) before building anything; --resume / auto skip damaged ones
        self.resume_from = checkpoint.choose_resume(cfg.run_dir, opts.resume, cfg.model.to_dict(),
                                                    warn=lambda msg: print(f"{PROG}: {msg}", file=sys.stderr))
        # changed settings: applied (reported by describe) or refused here, before anything is written
        self.resumed_run = resume.saved_run(self.resume_from) if self.resume_from is not None else None
        self.init_from = None  # --train.init_from on a fresh start: (checkpoint, its meta.json), verified like a resume
        if cfg.train.init_from and self.resume_from is None:
            self.init_from = checkpoint.choose_init(cfg.train.init_from, cfg.model.to_dict(),
                                                    warn=lambda msg: print(f"{PROG}: {msg}", file=sys.stderr))
        self.changes = resume.check((self.resumed_run or {}).get("config"), cfg.to_dict(), self.resume_from,
                                    excluded(cfg.checkpoint.exclude_from_loading))
        for key, saved, _ in self.changes.kept:  # config.json records what runs: the checkpoint's value
            section, name = key.split(".", 1)
            setattr(getattr(cfg, section), name, saved)
        # the step this data phase began at: the checkpoint's when this resume changes the data (its position is
        # then not loaded), else the checkpoint's own record; keys the sampler's order (moekit.train.data.Sampler)
        self.data_phase = (resume.data_phase(self.resumed_run, self.changes, checkpoint.step_of(self.resume_from))
                           if self.resume_from is not None else 0)
        self.sampler = self.split.sampler(cfg.train.seed, self.data_phase)  # data.Sampler, or data.BlendSampler
        self.tasks = None  # --eval.tasks: read and encoded now, scored at every evaluation (train.task_loop)
        if cfg.eval.tasks:
            from moekit.train.task_loop import InLoopTasks

            self.tasks = InLoopTasks.prepare(cfg, self.data, self.split)

    # -- setup ------------------------------------------------------------------------------------

    def build(self) -> None:
        cfg, plan = self.cfg, self.plan
        torch.manual_seed(cfg.train.seed)  # router jitter and any other global-RNG draws
        with meta_device():
            self.model = Transformer(cfg.model)
        self.parts = grad_parts.present(self.model)  # the whole model's (a pipeline rank holds some of them)
        # --train.trainable / freeze / train_experts: what trains, by one-process name (None: everything)
        self.freeze = freezing.plan(self.model, cfg)
        if self.freeze is not None:  # mfu's numerator: frozen weights compute no weight gradient
            import dataclasses

            from moekit.models.stats import frozen_wgrad_flops

            skipped = frozen_wgrad_flops(cfg.model, self.freeze.frozen, cfg.train.seq_len, self.model)
            self.plan = dataclasses.replace(self.plan, flops_per_token=self.plan.flops_per_token - skipped)
        # which experts each EP rank holds: a placement file, a rebalancing run's checkpoint, or contiguous blocks
        self.placement = RunPlacement.for_run(cfg, self.dist.topology, self.model, self.resume_from)
        # The model stays on the meta device until it is parallelised; each rank then allocates its share and fills
        # it: from the seed (models.init: every value depends on the seed, the name and the position only, so this
        # is the one-process model's share whatever the layout), with --init-from-hf reading only its slices
        # (models.hf.load_hf_sharded: placed experts from their logical rows, MTP depths the folder lacks from the
        # seed), or upcycled from a dense model (models.upcycle.upcycle_into: its shards of the upcycled model, from
        # the slices of the dense model they are made of).
        fresh = self.resume_from is None
        dense = None
        if cfg.train.init_from_dense and fresh:  # opened (headers) and checked before anything is built
            from moekit.train.upcycle import read_dense

            dense = read_dense(cfg.model, cfg.train.init_from_dense, cfg.train.upcycle_granularity)
        if cfg.train.export_hf:  # refuse before training, not after: a family for the model, a tokenizer
            self.export_tokenizer = hfrun.check_export(self.model, cfg, self.data)
        # each rank keeps its share: its pipeline stages first, then the recipe (TP, EP, AC, compile, FSDP) on them
        fsdp_dtype = plan.autocast_dtype if plan.device.type == "cuda" else None  # bf16 params, fp32 reduction
        self.pipe = None
        if cfg.layout.pp > 1:
            from moekit.models.pipeline import build_pipeline

            self.pipe = build_pipeline(self.model, self.dist.topology, cfg.layout.pp_schedule,
                                       cfg.layout.pp_stages_per_rank, cfg.train.seq_len,
                                       activation_dtype=plan.residual_dtype or fsdp_dtype, device=plan.device)
            self.model = self.pipe.model  # this rank's stages, single-process parameter names
        self.dist.parallelize(self.model, plan.resolved.hierarchical,
                              activation_checkpointing=cfg.train.activation_checkpointing,
                              compile=cfg.train.compile, param_dtype=fsdp_dtype,
                              sequence_parallel=cfg.layout.sequence_parallel,
                              expert_placement=self.placement.placements,
                              ep_overlap_chunks=cfg.layout.ep_overlap_chunks)
        if self.document_eos is not None:  # attention within documents: every forward splits its sequences at EOS
            set_attribute(self.model, "document_eos", self.document_eos)  # the model, or this rank's stages
        if plan.residual_dtype is not None:  # train.residual_dtype: the embedding's output cast (models.transformer)
            set_attribute(self.model, "residual_dtype", plan.residual_dtype)
        # on the meta device until now: each rank allocates and fills only what it holds
        self.model.to_empty(device=plan.device)
        grad_parts.tag(self.model)  # each parameter's part, for grad_norm_by_part (to_empty made new Parameters)
        if self.dist.active:  # to_empty made new Parameters: mark the replicated experts' rows again
            from moekit.comm.relocate import tag_primaries

            tag_primaries(self.model)
        if cfg.train.init_from_hf and fresh:
            hfrun.load_init(self.model, cfg.train.init_from_hf, cfg.train.seed)
        elif self.init_from is not None:  # --train.init_from: a moekit checkpoint's weights, nothing else
            adapters = bool(self.init_from[1]["model"].get("lora_rank", 0))
            if cfg.model.lora_rank and not adapters:  # a source without LoRA adapters: fresh ones (models.lora)
                from moekit.models.init import canonical_name
                from moekit.models.lora import is_adapter

                init_weights(self.model, cfg.train.seed,
                             only={canonical_name(n) for n, _ in self.model.named_parameters() if is_adapter(n)})
            checkpoint.load_weights(self.init_from[0], self.model, adapters=adapters)
        elif dense is not None:  # dense-to-MoE upcycling
            from moekit.train.upcycle import init_from_dense

            for note in init_from_dense(self.model, dense, cfg.train.init_from_dense, cfg.train.upcycle_granularity,
                                        cfg.train.seed, cfg.train.upcycle_drop):
                if self.dist.is_main:
                    _warn(note)
            del dense
        else:
            init_weights(self.model, cfg.train.seed)
        self.model.train()
        if cfg.train.qk_clip:  # models.qk_clip: record each head's largest logit, on the model as it trains
            from moekit.models import qk_clip

            qk_clip.track(self.model)
        # the aux loss is averaged like the LM loss: over the micro-batches and over TP's token slices
        pipelined = self.pipe is not None
        set_aux_loss_scale(self.model, accumulation=1 if pipelined else plan.accum,
                           microbatches=plan.accum if pipelined else 1, token_slices=self.dist.topology.layout.tp)
        self.aux_accum = plan.accum  # the micro-batch count the aux-loss scale is set for (a ramp changes it)
        self.guard = Guard(self.model, self.dist, cfg.train.on_nonfinite)
        self.spikes = None  # --train.spike_skip: the recent good steps' loss and grad norm (train.spikes)
        if cfg.train.spike_skip > 0:
            saved = None if self.changes.new_data else (self.resumed_run or {}).get(spikes.STATE_KEY)
            self.spikes = spikes.SpikeGuard(cfg.train.spike_skip, cfg.train.spike_window, saved)
        freezing.apply(self.model, self.freeze)  # requires_grad, frozen router biases, expert row masks
        self.optimizer = make_optimizer(self.model, cfg, self.freeze)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        t = cfg.train  # --train.ema_decay: the parameters' running average, in the optimizer state (train.ema)
        self.ema = ema.ParameterEMA(self.optimizer, t.ema_decay, t.ema_every, t.ema_start) if t.ema_decay else None
        self.start_step = 0
        self.val_mtp: float | None = None  # the MTP depths' loss at the last evaluation (models.mtp)
        self.val_by_source: dict[str, float] | None = None  # a blend's loss per set at the last evaluation
        if self.resume_from is not None:
            fresh = resume.optimizer_settings(self.optimizer)  # this run's lr, betas, eps, weight decay
            faults.inject_fault(self.run_dir, "resume", self.dist.rank)  # testing hook, off unless its env is set
            self.start_step = checkpoint.load(self.resume_from, self.model, self.optimizer, self.scheduler,
                                              self.sampler, cfg.model.to_dict(), verify=False,
                                              load_data=not self.changes.new_data, ema=self.ema is not None)
            resume.apply_optimizer_settings(self.optimizer, self.scheduler, fresh)
        self.tokens_seen = resume.tokens_at(self.resumed_run, self.start_step, plan.tokens_per_step)
        self.last_checkpoint = self.resume_from
        self.checkpointer = checkpoint.Checkpointer(self.run_dir, cfg.checkpoint.keep, cfg.model.to_dict(),
                                                    cfg.checkpoint.async_save, last=self.resume_from,
                                                    timeout_s=cfg.layout.timeout_s, warn=_warn,
                                                    keep_every=cfg.checkpoint.keep_every)

    def open_records(self) -> None:
        # every MoE layer's name for the load record's header: under pp, rank 0 holds only its stages
        layers = self.gathered_load(reset=False) if self.pipe is not None else None
        if not self.dist.is_main:  # rank 0 writes the records; the others only compute
            self.metrics = self.load_log = self.monitor = None
            return
        d = self.run_dir
        if self.resume_from is None:
            # and what tools drew from those records, which would otherwise pass for this run's
            stale = [d / n for n in (records.METRICS, records.EXPERT_LOAD, records.EXPERT_LOAD_BIN, records.CONFIG,
                                     "checkpoints", "tensorboard", "wandb", "expert_load.png", "expert_load_steps.png")]
            kept = records.set_aside(d) if self.opts.resume is not None else ""  # --resume auto, no checkpoint
            if kept:
                _warn(kept)  # what is left of `stale`: checkpoints/ with at most a crashed save's .partial
            elif any(p.exists() for p in stale):
                print(f"note: starting a fresh run in {d}: deleting the records and checkpoints there")
            for p in stale:
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        d.mkdir(parents=True, exist_ok=True)
        for name in (records.METRICS, records.EXPERT_LOAD, records.EXPERT_LOAD_BIN):
            records.truncate_after(d / name, self.start_step)
        (d / records.CONFIG).write_text(json.dumps(self.cfg.to_dict(), indent=1))
        record_tokenizer(d, self.data.tokenizer)  # tokenizer.json + tokenizer_info.json: how to decode this run
        self.metrics = records.JsonlWriter(d / records.METRICS)
        cfg = self.cfg
        # expert_load.bin every `stride`-th step (and the last); 0 = the smallest stride under ~2 GiB
        stride = cfg.log.load_every or records.auto_stride(cfg.model.num_moe_layers, cfg.model.num_experts,
                                                            cfg.train.steps)
        self.load_log = records.ExpertLoadWriter(d / records.EXPERT_LOAD_BIN,
                                                 layers or collect_load(self.model, reset=False), cfg.model.router,
                                                 cfg.model.top_k, stride=stride,
                                                 max_count=self.plan.tokens_per_step * max(cfg.model.top_k, 1))
        self.monitor = Monitor(str(d), self.plan.device, cfg.train.steps, self.start_step, cfg.log.every,
                               cfg.log.tensorboard, cfg.log.progress, load_every=stride, wandb=cfg.log.wandb,
                               wandb_project=cfg.log.wandb_project, config=cfg.to_dict())

    def describe(self) -> None:
        run_lines.describe(self)

    # -- the loop -----------------------------------------------------------------------------------

    def autocast(self):
        dt = self.plan.autocast_dtype
        return torch.autocast(self.plan.device.type, dtype=dt) if dt is not None else contextlib.nullcontext()

    def windows(self, starts: np.ndarray, held_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and targets (CPU) of the windows at ``starts`` of the training data (``held_out``: of
        the validation data); targets a loss mask leaves out are IGNORE_INDEX."""
        split = self.split
        tokens, mask = (split.held_out, split.held_out_mask) if held_out else (split.tokens, split.mask)
        return self.dist.positions(*gather(tokens, starts, self.cfg.train.seq_len, mask, self.data.tokenizer.eos_id))

    def forward_loss(self, starts: np.ndarray, held_out: bool = False, batch=None) -> torch.Tensor:
        """The loss of the windows at ``starts`` (or of ``batch``, their ``windows``): the mean over the counted
        targets, or in a training step with loss masks their sum over the step's count (set_loss_normalizer)."""
        x, y = self.windows(starts, held_out) if batch is None else batch
        self.watch.pet()  # an evaluation's forwards are progress too (moekit.train.stalls)
        x, y = x.to(self.plan.device), y.to(self.plan.device)  # [b, S] each (S / cp under context parallelism)
        with self.autocast():
            if self.pipe is not None:  # forward only (evaluation); the loss arrives on every pipeline rank
                return self.pipe.evaluate(x, y, 1)
            return self.model(x, targets=y)  # mean cross-entropy, no [b, S, V] logits kept (models.loss)

    def forward_backward(self, batch: np.ndarray, split: StepBatch | None = None) -> torch.Tensor:
        """This rank's share of one step: the summed loss of its micro-batches; gradients accumulated. ``split``:
        the step's micro-batches (a batch-size ramp's; default the run's)."""
        plan = self.plan
        micro, accum = (split.micro_batch, split.accum) if split is not None else (plan.micro_batch, plan.accum)
        if self.aux_accum != accum:  # a ramp step with another micro-batch count: each aux loss counts 1/accum
            piped = self.pipe is not None  # the schedule's micro-batches, or the accumulation loop's
            set_aux_loss_scale(self.model, accumulation=1 if piped else accum, microbatches=accum if piped else 1,
                               token_slices=self.dist.topology.layout.tp)
            self.aux_accum = accum
        if self.pipe is not None:  # the schedule runs every micro-batch's forward and backward (a ramp: fewer of them)
            x, y = self.windows(batch)
            with self.autocast():
                loss = self.pipe.step(x.to(plan.device), y.to(plan.device), accum)
            return loss.detach() * accum
        loss_sum = torch.zeros((), device=plan.device)
        for m in range(accum):
            loss = self.forward_loss(batch[m * micro : (m + 1) * micro])
            (loss / accum).backward()
            loss_sum += loss.detach()
        return loss_sum

    def set_loss_normalizer(self, batch: np.ndarray, accum: int | None = None) -> int | None:
        """With loss masks: the global ``batch``'s counted targets N, and every micro-batch's loss made its summed
        token losses over N / (R M) (R the ranks whose losses and gradients are averaged, data and context
        parallel; M the micro-batches per rank), so that the step's loss and gradient are the mean over all N
        targets however they fall on micro-batches and ranks; each multi-token-prediction depth k alike, over its
        N_k counted targets k ahead (models.mtp). Returns N; None (and nothing set) without masks."""
        if self.split.mask is None:
            return None
        keep = counted_targets_of(self.split.tokens, self.split.mask, batch, self.cfg.train.seq_len,
                                  self.data.tokenizer.eos_id)  # [n, S] bool
        share = self.dist.loss_ranks * (accum or self.plan.accum)
        depths = self.cfg.model.mtp_layers
        per_position = keep.sum(axis=0, dtype=np.int64)  # [S]: one pass over the batch
        n = [int(per_position[k:].sum()) for k in range(depths + 1)]  # depth k predicts the targets k on
        normalizer = max(n[0], 1) / share  # none counted: loss 0
        mtp = tuple(max(c, 1) / share for c in n[1:]) if depths else None
        for root in (self.model, *getattr(self.model, "stages", ())):
            if hasattr(root, "loss_normalizer"):
                root.loss_normalizer = normalizer
                root.mtp_normalizers = mtp
        return n[0]

    def gathered_load(self, reset: bool) -> dict:
        """Expert load of every MoE layer (all pipeline stages), summed over the stage's ranks (collective)."""
        load = collect_load(self.model, reset=reset)
        if self.pipe is not None:
            load = self.pipe.gather_load(load)
        return self.dist.reduce_load(load)

    def train(self) -> int:
        # a multi-rank run's watchdog: a rank without progress for --layout.timeout_s writes every thread's stack
        # (moekit.train.stalls), so a collective that times out can say where each rank was
        self.watch = stalls.StallWatch(self.run_dir, self.dist.rank, self.cfg.layout.timeout_s, self.dist.active)
        try:
            self.build()
            self.watch.pet()
            self.open_records()
            self.describe()
        except RuntimeError as exc:  # a collective of the set-up (the checkpoint load's) that timed out
            failure = self.dist.failure(exc, None)
            where = stalls.summarize(self.run_dir, self.dist.world) if failure is not None else None
            self.watch.close()
            if failure is not None:
                raise RunFailed(failure + (f"; {where}" if where else "")) from None
            raise
        except BaseException:
            self.watch.close()
            raise
        self.profiler = self.make_profiler()
        self.step = self.start_step
        ended = False  # loop() returned on this rank: every rank did (its ends are collective decisions)
        try:
            with faults.StopSignals() as signals:  # SIGTERM / SIGINT: save at the next step boundary
                self.signals = signals
                self.dist.stop_signal = lambda: signals.received
                code = self.loop()
                ended = True
                return code
        except RunFailed as exc:  # a save another rank did not finish in time: where each rank was, if they said
            where = stalls.summarize(self.run_dir, self.dist.world) if getattr(exc, "stalled", False) else None
            if where:
                raise RunFailed(f"{exc}; {where}") from None
            raise
        except OSError as exc:  # records (metrics.jsonl, ...): a full disk or a permission
            raise RunFailed(f"{runlock.describe_os_error(exc)} at step {self.step}; {self.kept()}; free space or fix "
                            f"permissions") from None
        except RuntimeError as exc:  # torch.OutOfMemoryError too
            if self.profiler is not None:  # --profile.memory: the allocations that led to an out-of-memory error
                self.profiler.on_error(exc, self.step, _warn)
            self.guard.explain_oom(exc)  # an OOM inside an expert becomes one line naming it
            failure = self.dist.failure(exc, self.step)  # a collective that timed out or lost its peer
            if failure is not None:
                where = stalls.summarize(self.run_dir, self.dist.world)  # the ranks' stall reports, if any
                raise RunFailed(f"{failure}; {self.kept()}" + (f"; {where}" if where else "")) from None
            raise
        finally:
            self.watch.close()
            if self.profiler is not None:  # a window the run left early writes nothing
                self.profiler.close()
            self.checkpointer.close()  # an async save in flight ends before the process group goes
            self.restore_determinism()
            for rec in (self.metrics, self.load_log, self.monitor):
                if rec is not None:
                    rec.close()
            self.dist.close(together=ended)
            if self.run_lock is not None:
                self.run_lock.release()

    def save(self, step: int) -> Path | None:
        """Checkpoint after ``step``; its meta.json records this run's settings and tokens (moekit.train.resume)."""
        run = {"config": self.cfg.to_dict(), "tokens": self.tokens_seen, "data_phase": self.data_phase}
        if self.spikes is not None:  # a resumed run skips the steps an uninterrupted one would
            run[spikes.STATE_KEY] = self.spikes.state()
        if self.ema is not None and self.ema.started:  # the optimizer state holds the average (moekit.train.ema)
            run[ema.RUN_KEY] = self.ema.record()
        self.watch.pet()  # a save is bounded by --layout.timeout_s on its own
        return self.checkpointer.save(step, self.model, self.optimizer, self.scheduler, self.sampler, run=run,
                                      placement=self.placement.record())

    def kept(self) -> str:
        last = self.checkpointer.last
        return f"newest checkpoint: {last} (--resume continues from it)" if last else "no checkpoint saved yet"

    def loop(self) -> int:
        cfg, plan = self.cfg, self.plan
        params = list(self.model.parameters())
        t_start = time.perf_counter()
        stop = 0
        for step in range(self.start_step + 1, cfg.train.steps + 1):
            if stop:  # a signal, agreed on in the last step's check: every rank saves that step and exits
                return self.preempt(step - 1, stop)
            self.step = step
            self.watch.pet()  # progress: the stall watchdog starts again (moekit.train.stalls)
            faults.inject_fault(self.run_dir, step, self.dist.rank)  # testing hook, off unless its env is set
            self.profiler.begin(step)  # --profile.every: a window's first step starts the profiler
            t0 = time.perf_counter()
            self.guard.begin_step(step)
            split = plan.step_batch(cfg.train, step)  # the run's batch, or a batch-size ramp's for this step
            batch = self.sampler.next(split.size)  # [batch size] window starts of the global batch
            counted = self.set_loss_normalizer(batch, split.accum)  # loss masks: the step's targets that count
            batch = self.dist.share(batch, split.per_rank)  # this rank's contiguous share
            loss_sum = self.forward_backward(batch, split)
            self.dist.sync_grads(self.model)  # the global-batch gradient on every rank
            if self.freeze is not None and self.freeze.experts is not None:  # --train.train_experts
                freezing.mask_gradients(params)  # frozen experts' rows: no gradient, no share of the norm
            loss_value = self.dist.mean(loss_sum / split.accum).item()  # D2H sync: finiteness check, records
            mtp = (self.pipe or self.model).pop_mtp_loss() if cfg.model.mtp_layers else None  # models.mtp: depths' mean
            mtp_value = self.dist.mean(mtp).item() if mtp is not None else None  # D2H sync (only with MTP)
            grad_norm, by_part = self.dist.clip_grad_norm(params, cfg.train.grad_clip, len(grad_parts.PARTS))
            grad_norm, *by_part = torch.cat([grad_norm.reshape(1), by_part]).tolist()  # D2H sync: before the update
            spike = self.spikes.check(loss_value, grad_norm) if self.spikes is not None else None
            event = self.guard.check(step, loss_value, grad_norm, spike)  # collective: every rank decides alike
            stop = self.dist.agree_stop()  # rode on that collective: a signal on any rank stops all of them
            if event is not None and event.action == "stop":
                return self.stop_nonfinite(event, step)
            if event is not None:  # skip: no optimizer, schedule or router-bias update; the batch is consumed
                self.skip_step(event, step, self.part_norms(by_part))
                self.profiler.end(step)
                self.profiler.report()
                continue
            lr = base_lr(self.optimizer)
            if self.spikes is not None:
                self.spikes.accept(loss_value, grad_norm)
            if self.freeze is not None and self.freeze.experts is not None:
                freezing.decay_rows(self.optimizer)  # the trained expert rows' weight decay (train.freezing)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            update_router_biases(self.model)
            clipped = self.qk_clip()  # models.qk_clip (--train.qk_clip), after the update: collective over the stage
            if self.ema is not None:  # --train.ema_decay: the weights as they will be trained on from here
                self.ema.update(step)
            load = self.gathered_load(reset=True)  # D2H sync: per MoE layer
            if self.placement.observe(step, load, self.model, self.optimizer):  # --layout.rebalance_every
                freezing.tag_experts(self.model, self.freeze)  # the slots hold other experts now
                if self.dist.is_main:
                    self.monitor.print(self.placement.last_note)
            dt = time.perf_counter() - t0
            step_tokens = split.size * cfg.train.seq_len
            self.tokens_seen += step_tokens
            m = self.step_metrics(step, loss_value, grad_norm, lr, load, dt, self.tokens_seen,
                                  time.perf_counter() - t_start, step_tokens)
            m["grad_norm_by_part"] = self.part_norms(by_part)
            if cfg.train.batch_size_start:  # a batch-size ramp: this step's global batch
                m["batch_size"] = split.size
            if mtp_value is not None:
                m["mtp_loss"] = mtp_value
            if counted is not None:  # loss masks: the targets the step's loss is the mean over
                m["loss_tokens"] = counted
            if clipped is not None:  # this rank's stage's largest attention logit, and the heads rescaled
                m["max_logit"], m["qk_clipped_heads"] = clipped["max_logit"], clipped["clipped_heads"]
            if self.data.weights is not None:  # a blend: tokens drawn from each set so far
                m["tokens_by_source"] = self.sampler.tokens_by_source(cfg.train.seq_len)
            self.profiler.end(step)  # a window's step ends before evaluation and checkpoints
            if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                m["val_loss"] = self.evaluate()
                if self.val_by_source is not None:  # a blend: each set's share of the validation windows
                    m["val_loss_by_source"] = self.val_by_source
                if cfg.model.mtp_layers:  # the depths' loss on the same windows (models.mtp)
                    m["val_mtp_loss"] = self.val_mtp
                if self.tasks is not None:  # --eval.tasks: each task's accuracies
                    m["tasks"] = self.tasks.evaluate(self)
                if self.ema is not None and cfg.eval.ema and self.ema.started:  # the same windows, averaged weights
                    m["val_loss_ema"], tasks = self.evaluate_ema()
                    if tasks is not None:  # --eval.tasks: the same items with the averaged weights
                        m["tasks_ema"] = tasks
            if self.dist.is_main:
                self.metrics.write(self.monitor.step(m, load))  # + balance_loss, z_loss, cv, dead_experts
                self.load_log.write(step, load, force=step == cfg.train.steps)
            self.profiler.report()  # a window that ended at this step: its line after the step's
            if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == cfg.train.steps):
                self.last_checkpoint = self.save(step)
        self.last_checkpoint = self.checkpointer.finalize()  # an async save is sealed before the run ends
        if cfg.train.export_hf:
            if cfg.train.steps not in (self.checkpointer.saved_step, self.start_step):  # the export's fallback
                self.save(cfg.train.steps)
                self.last_checkpoint = self.checkpointer.finalize()
            self.watch.pet()
            averaged = cfg.train.export_hf_ema and self.ema is not None and self.ema.started
            with self.ema.swapped() if averaged else contextlib.nullcontext():  # --train.export_hf_ema: the average
                folder = hfrun.export(self.model, cfg, self.export_tokenizer, self.last_checkpoint, PROG)
            if self.dist.is_main:
                self.monitor.print(hfrun.exported(folder, cfg.train.export_hf_fp8, cfg.train.export_hf_mxfp4)
                                   + (": the parameter EMA" if averaged else ""))
        if self.dist.is_main:
            self.finish()
        return 0

    def make_profiler(self):
        """[profile]'s StepProfiler (moekit.train.profiling); inert with --profile.every 0 unless --profile.memory."""
        from moekit.train.profiling import StepProfiler

        cfg = self.cfg
        say = self.monitor.print if self.dist.is_main else print
        # a compiled block is one graph: module hooks inside it would recompile it (the trace keeps every kernel)
        return StepProfiler(cfg.profile, self.run_dir, self.dist.rank, self.dist.is_main, self.plan.device,
                            self.model, self.start_step, cfg.train.steps, module_labels=not cfg.train.compile,
                            print_fn=say)

    def qk_clip(self) -> dict | None:
        """QK-clip after an optimizer step (--train.qk_clip; models.qk_clip): each head's largest logit reduced over
        this pipeline stage's ranks, the heads over the bound rescaled; None when off."""
        if not self.cfg.train.qk_clip:
            return None
        from moekit.models import qk_clip

        group = self.dist.topology.group("stage") if self.dist.active else None
        return qk_clip.clip(self.model, self.cfg.train.qk_clip, group)

    def step_metrics(self, step, loss, grad_norm, lr, load, dt, tokens_seen, elapsed, step_tokens=None) -> dict:
        tps = (step_tokens or self.plan.tokens_per_step) / dt
        peak = peak_flops(self.plan.device, self.plan.autocast_dtype)
        m = {"step": step, "loss": loss, "aux_loss": sum(s.aux_loss / max(s.forwards, 1) for s in load.values()),
             "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps, "step_s": dt, "tokens": tokens_seen,
             "elapsed_s": elapsed,
             "mem_gb": peak_memory_gb(self.plan.device),
             # tokens_per_s is the whole job's; every rank's device contributes its peak
             "mfu": tps * self.plan.flops_per_token / (peak * self.dist.world) if peak else None}
        if load:
            imb = [s.imbalance for s in load.values()]
            assigned = sum(s.total_slots for s in load.values())
            m.update(imbalance=sum(imb) / len(imb), imbalance_max=max(imb),
                     dropped_fraction=sum(s.dropped_slots for s in load.values()) / max(assigned, 1))
        return m

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over fixed validation windows spread evenly over the held-out blocks; a blend's sets are
        evaluated one after the other, and each one's mean is kept in ``val_by_source`` (None for one set)."""
        groups = self.split.validation_groups(self.cfg.eval.sequences)  # a blend: a fixed mix by weight, per set
        D = self.dist.data_parallel  # each rank takes an equal share (same forward count: EP collectives)
        shares = []
        for _, starts in groups:
            n = starts.size
            starts = starts[: n - n % D] if n >= D else starts[np.arange(D) % n]
            shares.append(starts.reshape(D, -1)[self.dist.data_rank])
        self.model.eval()
        mtp = [m for m in (self.model, *getattr(self.model, "stages", ())) if hasattr(m, "mtp_in_eval")]
        for m in mtp:  # the MTP depths record their loss on these windows too (val_mtp_loss)
            m.mtp_in_eval = True
        totals = torch.zeros(len(groups), device=self.plan.device)
        counts = torch.zeros(len(groups))  # each group's targets that count (a loss mask leaves some out)
        try:
            for g, mine in enumerate(shares):
                for i in range(0, mine.size, self.plan.micro_batch):
                    part = mine[i : i + self.plan.micro_batch]
                    x, y = self.windows(part, held_out=True)
                    counted = int((y != IGNORE_INDEX).sum())  # this rank's targets that count: the loss's mean
                    totals[g] += self.forward_loss(part, batch=(x, y)) * counted
                    counts[g] += counted
        finally:
            for m in mtp:
                m.mtp_in_eval = False
            self.model.train()
        if self.cfg.model.mtp_layers:  # a mean over micro-batches of equal size: the windows' mean
            depth = (self.pipe or self.model).pop_mtp_loss()
            self.val_mtp = self.dist.mean(depth).item() if depth is not None else None
        # every rank's sums over every rank's counts (a loss mask counts unequal shares); D2H sync: once
        sums = self.dist.mean(torch.stack([totals, counts.to(totals.device)])).tolist()
        means = [t / max(c, 1.0) for t, c in zip(*sums)]
        self.val_by_source = dict(zip([name for name, _ in groups], means)) if len(groups) > 1 else None
        return sum(sums[0]) / max(sum(sums[1]), 1.0)

    def evaluate_ema(self) -> tuple[float, dict | None]:
        """``evaluate`` (and --eval.tasks' scores, else None) with the parameter average (--train.ema_decay) in place
        of the weights, in one swap; the trained weights' per-set and MTP results stay those of the last plain
        evaluation."""
        kept = self.val_by_source, self.val_mtp
        with self.ema.swapped():
            loss = self.evaluate()
            tasks = self.tasks.evaluate(self) if self.tasks is not None else None
        self.val_by_source, self.val_mtp = kept
        return loss, tasks

    def part_norms(self, by_part: list[float]) -> dict[str, float]:
        """{part: its gradient norm} of the parts the model has (moekit.train.grad_parts)."""
        return {part: by_part[grad_parts.PARTS.index(part)] for part in self.parts}

    def skip_step(self, event: NonFinite, step: int, parts: dict[str, float]) -> None:
        """A skipped step's record and line; ``parts``: its gradient norm by part (which part spiked or went bad)."""
        self.guard.discard_step(self.model, self.optimizer)
        if self.cfg.train.qk_clip:  # the skipped step's logits do not count (no update took place)
            from moekit.models import qk_clip

            qk_clip.reset(self.model)
        if self.dist.is_main:
            record = event.record(step, base_lr(self.optimizer))
            record["grad_norm_by_part"] = {k: v if math.isfinite(v) else None for k, v in parts.items()}
            self.metrics.write(record)
            finite = {k: v for k, v in parts.items() if math.isfinite(v)}
            bad = [k for k, v in parts.items() if not math.isfinite(v)]
            part = (f"; non-finite gradient in {', '.join(bad)}" if bad else
                    f"; the largest part of the gradient norm: {max(finite, key=finite.get)} "
                    f"{max(finite.values()):.4g}" if finite else "")
            self.monitor.print(f"step={step} skipped: {event.describe()}; {event.where}{part}")

    def stop_nonfinite(self, event: NonFinite, step: int) -> int:
        self.optimizer.zero_grad(set_to_none=True)
        good = self.last_checkpoint or "none saved yet"
        if not self.dist.is_main:
            return 1
        self.monitor.progress.clear()
        skips = self.guard.consecutive_skips
        if event.kind == "spike":  # --train.spike_skip: skipped MAX_CONSECUTIVE_SKIPS times in a row
            print(f"{PROG}: error: {event.describe()} at step {step} after {skips} skipped steps in a row: {event.where}; "
                  f"a loss that stays this high has moved, not spiked. Stopped before its optimizer step. Last good "
                  f"checkpoint: {good}. Resume from it with a lower --train.lr, or a larger --train.spike_skip",
                  file=sys.stderr)
            return 1
        gave_up = f" after {skips} skipped steps in a row" if event.action != self.cfg.train.on_nonfinite else ""
        print(f"{PROG}: error: non-finite {event.what} ({event.value}) at step {step}{gave_up}; stopped before its "
              f"optimizer step; first seen in {event.where}. Last good checkpoint: {good}. Lower --train.lr or raise "
              f"--train.warmup_steps", file=sys.stderr)
        return 1

    def preempt(self, step: int, signum: int) -> int:
        """Every rank: save after ``step`` (unless that save is under way), wait until it is sealed, and
        return 128 + signal. A repeated signal meanwhile is ignored; SIGKILL leaves an unsealed save."""
        if self.checkpointer.saved_step != step:
            self.save(step)
        self.last_checkpoint = self.checkpointer.finalize()
        if self.dist.is_main:
            self.monitor.progress.clear()
            repeats = self.signals.repeats
            ignored = f" ({repeats} more signal{'s' * (repeats > 1)} ignored while stopping)" if repeats else ""
            print(f"{PROG}: stopped by {faults.signal_name(signum)} after step {step} of {self.cfg.train.steps}: "
                  f"saved {self.last_checkpoint}{ignored}; continue with the same command and --resume (under "
                  f"torchrun --max-restarts, --resume auto continues by itself)", file=sys.stderr, flush=True)
        return 128 + signum

    def finish(self) -> None:
        run_lines.finish(self)


def base_lr(optimizer) -> float:
    """The run's learning rate at this step (--train.lr on its schedule), whatever --train.lr_scale's groups hold."""
    g = optimizer.param_groups[0]
    return g["lr"] / g.get("lr_scale", 1.0)


def document_eos(cfg: TrainConfig, data) -> int | None:
    """The end-of-document id that --data.document_mask splits sequences at (None when it is off), or a UserError
    when the data marks no document ends."""
    if not cfg.data.document_mask:
        return None
    eos = data.tokenizer.eos_id
    if eos is None:
        raise UserError(f"--data.document_mask true needs the data's end-of-document id, and {data.desc} has none "
                        f"(text tokenised as bytes, or prepared with --no-eos); prepare it with an EOS "
                        f"(moekit-prepare's default) or turn document masking off")
    return eos
