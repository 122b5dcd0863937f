"""Downstream tasks during training (``--eval.tasks``): the multiple-choice tasks of moekit.train.tasks scored at
every evaluation, under any parallel layout, into metrics.jsonl's ``tasks`` ({name: {acc, acc_norm, correct_nll,
chance, items}}: task_eval's meanings), TensorBoard / W&B (``tasks/<name>/acc``, ``acc_norm``, ``correct_nll``) and the
console line (acc_norm).

The items are read and encoded once, when the run starts (task_eval.encode_task, with the data's tokenizer and the
run's seq_len; every rank alike). At an evaluation each choice is one sequence: its context and continuation,
padded after them to the task's longest choice (rounded up; a causal model's scores do not see the padding). Two
ways to score them, the same numbers (tests/test_train_distributed.py compares layouts that take either):

    batched      without a pipeline or context parallelism the model returns the logits of whole sequences:
                 several choices a forward (their logits at most LOGIT_BUDGET floats), read at the
                 continuations (dp, fsdp, ep, tp with or without sequence parallelism)
    one by one   any layout: each choice a forward through the trainer's own loss, with targets on the
                 continuation alone, which returns the continuation's mean token loss (its share of it on a
                 context-parallel rank); the pipeline's windows are seq_len long, as its schedule is built

The data-parallel ranks take every D-th choice (the same number of forwards each, as the expert-parallel
collectives need), and one all-reduce over the data-parallel group brings every choice's summed loss and its
target count to every rank: the log-likelihood is their ratio times the continuation's length. A capacity router
(switch) routes the padding too, as it routes every position of a window: its scores are those of the trained
capacity, as its val_loss is.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moekit.models.loss import IGNORE_INDEX
from moekit.train import UserError
from moekit.train.task_eval import Request, encode_task, task_result, token_logprobs
from moekit.train.builtin_tasks import WINDOWS_PER_ITEM, builtin_task, window_texts
from moekit.train.tasks import BUILTINS, Task, check_specs, read_task
from moekit.train.tokenizer import ByteTokenizer, HFTokenizer

WIDTH_GRAIN = 16  # a task's windows are a multiple of this many positions (times cp x tp), not all of seq_len
LOGIT_BUDGET = 1 << 26  # floats of logits one forward of several choices may make (256 MiB in float32)


def tokenizer_of(info, desc: str):
    """The encoder of the data's tokenizer (moekit.train.tokens.TokenizerInfo)."""
    if info.kind == "bytes":
        eos = info.eos_id
        return ByteTokenizer(eos, max(info.vocab_size or 256, 256 if eos is None else eos + 1))
    if info.kind == "hf" and info.file:
        return HFTokenizer(Path(info.file), add_special_tokens=False, eos_ids=() if info.eos_id is None else
                           (info.eos_id,))
    raise UserError(f"--eval.tasks needs the text of the data's tokens, but {desc} has no tokenizer record (token ids "
                    f"without metadata); train on data made by moekit-prepare, or leave --eval.tasks empty")


class InLoopTasks:
    def __init__(self, tasks: list[Task], requests: list[list[Request]], seq_len: int):
        self.tasks, self.requests, self.seq_len = tasks, requests, seq_len

    @classmethod
    def prepare(cls, cfg, data, split) -> "InLoopTasks":
        """Read and encode ``cfg.eval.tasks`` (every rank alike)."""
        tokenizer = tokenizer_of(data.tokenizer, data.desc)
        seq_len, limit = cfg.train.seq_len, cfg.eval.task_items
        tasks = []
        for spec in check_specs(cfg.eval.tasks, "--eval.tasks"):
            if spec in BUILTINS:
                texts = window_texts(split.held_out, split.validation(WINDOWS_PER_ITEM * limit), seq_len, tokenizer)
                try:
                    tasks.append(builtin_task(spec, texts, limit))
                except UserError as exc:
                    raise UserError(str(exc).replace("--seq-len", "--train.seq_len")) from None
            else:
                try:
                    tasks.append(read_task(spec, limit, cfg.eval.task_fewshot))
                except UserError as exc:  # moekit-eval's flags named in the message: the trainer's instead
                    raise UserError(str(exc).replace("--fewshot", "--eval.task_fewshot")
                                    .replace("--tasks", "--eval.tasks")) from None
        prefix = [] if tokenizer.eos_id is None else [tokenizer.eos_id]  # each training document follows an EOS
        requests = []
        for task in tasks:
            try:
                reqs, _ = encode_task(task, tokenizer, seq_len, prefix)
            except UserError as exc:  # moekit-eval's flag named in the message: the trainer's instead
                raise UserError(str(exc).replace("--seq-len", "--train.seq_len")) from None
            requests.append(reqs)
        return cls(tasks, requests, seq_len)

    def describe(self) -> str:
        return ", ".join(f"{t.name} ({len(t.items)} items, {len(r)} choices)" for t, r in zip(self.tasks, self.requests))

    def _one_by_one(self, trainer, reqs: list[Request], width: int, sums: torch.Tensor) -> None:
        """Any layout: each choice one window through the trainer's loss (its mean over this rank's counted
        targets: a share of them under context parallelism) into ``sums`` [2, choices]."""
        D, rank = trainer.dist.data_parallel, trainer.dist.data_rank
        for k in range(-(-len(reqs) // D)):  # every data-parallel rank runs as many forwards
            i = k * D + rank
            x, y = trainer.dist.positions(*self.row(reqs[min(i, len(reqs) - 1)], width))
            counted = int((y != IGNORE_INDEX).sum())
            loss = trainer.forward_loss(None, batch=(x, y))
            if i < len(reqs) and counted:
                sums[0, i] += loss.float() * counted
                sums[1, i] += counted

    def _batched(self, trainer, reqs: list[Request], width: int, sums: torch.Tensor) -> None:
        """Without a pipeline or context parallelism the model returns whole sequences' logits: several choices a
        forward (their [rows, width, vocab] logits at most LOGIT_BUDGET floats), read at the continuations."""
        D, rank, device = trainer.dist.data_parallel, trainer.dist.data_rank, trainer.plan.device
        rows = max(1, LOGIT_BUDGET // (width * trainer.cfg.model.vocab_size))
        mine = list(range(rank, len(reqs), D))  # this rank's choices: every D-th
        for start in range(0, -(-len(reqs) // D), rows):  # every data-parallel rank runs as many forwards
            part = mine[start : start + rows]
            batch = [reqs[i] for i in part] or [reqs[0]]  # a rank out of choices runs one, and drops it
            trainer.watch.pet()  # progress (moekit.train.stalls)
            with trainer.autocast():
                owner, logp = token_logprobs(trainer.model, batch, width, device)
            if part:
                index = torch.tensor(part, device=device)[owner]
                sums[0].index_add_(0, index, -logp.float())
                sums[1].index_add_(0, index, torch.ones_like(logp, dtype=sums.dtype))

    def width(self, reqs: list[Request], trainer) -> int:
        """A task's window: its longest choice rounded up to WIDTH_GRAIN x cp x tp positions (context and sequence
        parallelism split a window into equal parts), at most seq_len; the pipeline's schedule runs windows of
        seq_len only."""
        if trainer.pipe is not None:
            return self.seq_len
        layout = trainer.dist.topology.layout
        grain = WIDTH_GRAIN * layout.cp * layout.tp
        longest = max(len(req.ids) - 1 for req in reqs)
        return min(self.seq_len, -(-longest // grain) * grain)

    def row(self, req: Request, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One choice as the trainer's [1, width] inputs and targets (padding after it; targets on the
        continuation only)."""
        x = torch.zeros(1, width, dtype=torch.long)
        y = torch.full((1, width), IGNORE_INDEX, dtype=torch.long)
        n = len(req.ids) - 1
        x[0, :n] = torch.tensor(req.ids[:-1])
        y[0, n - req.cont : n] = torch.tensor(req.ids[-req.cont:])
        return x, y

    @torch.no_grad()
    def evaluate(self, trainer) -> dict:
        """Every task's accuracies with the trainer's model (module docstring); every rank gets them."""
        flat = [req for reqs in self.requests for req in reqs]
        device = trainer.plan.device
        sums = torch.zeros(2, len(flat), device=device)  # [summed token loss, counted targets] per choice
        batched = trainer.pipe is None and trainer.dist.context is None  # the model's logits are whole sequences'
        trainer.model.eval()
        try:
            at = 0
            for reqs in self.requests:
                width = self.width(reqs, trainer)
                view = sums[:, at : at + len(reqs)]
                (self._batched if batched else self._one_by_one)(trainer, reqs, width, view)
                at += len(reqs)
        finally:
            trainer.model.train()
        total, count = trainer.dist.mean(sums).double().cpu().numpy()  # D2H sync: once; ratios are kept
        conts = np.array([req.cont for req in flat], dtype=np.float64)
        loglik = -total / np.maximum(count, 1e-30) * conts
        out, at = {}, 0
        for task, reqs in zip(self.tasks, self.requests):
            r = task_result(task, reqs, loglik[at : at + len(reqs)])
            at += len(reqs)
            out[task.name] = {key: r[key] for key in ("acc", "acc_norm", "correct_nll", "chance", "items")}
        return out
