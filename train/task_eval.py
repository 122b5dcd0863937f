"""Scoring multiple-choice tasks (moekit.train.tasks) with a model: the log-likelihood of each choice's continuation
given its context, the accuracy of the most likely choice (``acc``) and of the most likely per character of the
continuation (``acc_norm``, which does not favour short choices), each with its standard error, beside chance;
and the right continuation's negative log-likelihood per token, averaged over the items (``correct_nll``, nats):
a smooth signal that moves long before a small model's accuracy does.

Encoding (``encode_task``): the context's trailing spaces move to the continuation (a tokenizer merges " word"
into one token), the pair is encoded as one text and the continuation is the tokens after the context's own
encoding, so the tokens are the ones the model saw in training; ``prefix`` ids go first (a moekit run's EOS, as
each training document follows one; an HF folder's tokenizer adds its own BOS). A request longer than the
window keeps its last tokens: the context is cut from the left, never the continuation.

``score_requests`` runs them in batches of similar length (right-padded: a causal model's scores at a row's
positions do not see the padding after them), and reads only the continuation positions' log-probabilities.
The trainer scores the same requests through its own forward under any parallel layout (moekit.train.trainer).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from moekit.train import UserError
from moekit.train.tasks import Task, chance, stderr

PROGRESS_EVERY_S = 5.0


@dataclass
class Request:
    item: int
    choice: int
    ids: list[int]  # the context's tokens, then the continuation's
    cont: int  # the continuation's token count: the last ``cont`` of ``ids``
    chars: int  # the continuation's characters (acc_norm)


def encode_task(task: Task, tokenizer, max_tokens: int, prefix: list[int]) -> tuple[list[Request], int]:
    """(the requests of every item's choices, how many were cut to fit ``max_tokens`` input positions)."""
    requests, cut = [], 0
    for i, item in enumerate(task.items):
        for c, (context, continuation) in enumerate(item.choices):
            chars = len(continuation)
            kept = context.rstrip(" ")
            context, continuation = kept, context[len(kept):] + continuation
            ctx = prefix + tokenizer.encode(context)
            ids = prefix + tokenizer.encode(context + continuation)
            cont = len(ids) - len(ctx)
            if cont < 1:
                raise UserError(f"{item.where}: choice {c + 1} ({continuation[:40]!r}) encodes to no token after its "
                                f"context; every choice needs some text")
            if len(ids) - cont < 1:
                raise UserError(f"{item.where}: the context is empty and the tokenizer has no end-of-text token to "
                                f"start from; give the item a context")
            if cont > max_tokens:
                raise UserError(f"{item.where}: choice {c + 1} is {cont} tokens, more than the {max_tokens} the window "
                                f"scores; use a larger --seq-len, or shorter choices")
            if len(ids) > max_tokens + 1:  # input positions are all but the last token
                ids, cut = ids[-(max_tokens + 1):], cut + 1
            requests.append(Request(i, c, ids, cont, chars))
    return requests, cut


def batches(requests: list[Request], token_budget: int) -> list[list[int]]:
    """Request indices in batches, longest first, each at most ``token_budget`` padded input positions (one
    request at least)."""
    order = sorted(range(len(requests)), key=lambda r: -len(requests[r].ids))
    out, current, width = [], [], 0
    for r in order:
        length = len(requests[r].ids) - 1
        if current and max(width, length) * (len(current) + 1) > token_budget:
            out.append(current)
            current, width = [], 0
        current.append(r)
        width = max(width, length)
    if current:
        out.append(current)
    return out


@torch.inference_mode()
def score_requests(forward: Callable[[torch.Tensor], torch.Tensor], requests: list[Request], token_budget: int,
                   device: torch.device, progress: Callable[[str], None] | None = None) -> np.ndarray:
    """Each request's continuation log-likelihood (nats, float64). ``forward``: ids [b, L] -> logits [b, L, V]."""
    out = np.zeros(len(requests))
    last, done = time.perf_counter(), 0
    for rows in batches(requests, token_budget):
        width = max(len(requests[r].ids) for r in rows) - 1
        owner, logp = token_logprobs(forward, [requests[r] for r in rows], width, device)
        sums = torch.zeros(len(requests), dtype=torch.float64, device=device)
        sums.index_add_(0, torch.tensor(rows, device=device)[owner], logp.double())
        out += sums.cpu().numpy()  # one D2H copy per batch
        done += len(rows)
        if progress is not None and time.perf_counter() - last > PROGRESS_EVERY_S and done < len(requests):
            progress(f"{done:,}/{len(requests):,} choices scored")
            last = time.perf_counter()
    return out


def token_logprobs(forward: Callable[[torch.Tensor], torch.Tensor], requests: list[Request], width: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``requests`` as rows of ``width`` positions (right-padded): (each continuation token's row
    index in ``requests``, its log-probability), both [tokens] on ``device``."""
    x = torch.zeros(len(requests), width, dtype=torch.long)
    where_row, where_pos, targets = [], [], []
    for b, req in enumerate(requests):
        n = len(req.ids) - 1
        x[b, :n] = torch.tensor(req.ids[:-1])
        where_row += [b] * req.cont
        where_pos += range(n - req.cont, n)  # position n - cont predicts the continuation's first token
        targets += req.ids[-req.cont:]
    logits = forward(x.to(device))  # [b, width, V]
    owner = torch.tensor(where_row, device=device)
    picked = logits[owner, torch.tensor(where_pos, device=device)].float()
    target = torch.tensor(targets, device=device)
    return owner, picked.gather(1, target[:, None]).squeeze(1) - picked.logsumexp(-1)


def item_scores(task: Task, requests: list[Request], loglik: np.ndarray) -> list[dict]:
    """Per item: each choice's log-likelihood and continuation tokens, and the choice picked by raw log-likelihood
    (``pred``) and by log-likelihood per character (``pred_norm``)."""
    out = [{"loglik": [0.0] * len(item.choices), "tokens": [0] * len(item.choices), "chars": [1] * len(item.choices)}
           for item in task.items]
    for req, ll in zip(requests, loglik.tolist()):
        row = out[req.item]
        row["loglik"][req.choice], row["tokens"][req.choice], row["chars"][req.choice] = ll, req.cont, max(req.chars, 1)
    for row in out:
        ll, chars = row["loglik"], row.pop("chars")
        row["pred"] = max(range(len(ll)), key=ll.__getitem__)
        row["pred_norm"] = max(range(len(ll)), key=lambda c: ll[c] / chars[c])
    return out


def task_samples(task: Task, requests: list[Request], loglik: np.ndarray) -> list[dict]:
    """moekit-eval --samples: one record per item (its text, the label, the picks and every choice's score)."""
    return [{"task": task.name, "item": i, "where": item.where, "context": item.choices[0][0],
             "choices": [cont for _, cont in item.choices], "label": item.label, **scores,
             "correct": scores["pred"] == item.label, "correct_norm": scores["pred_norm"] == item.label}
            for i, (item, scores) in enumerate(zip(task.items, item_scores(task, requests, loglik)))]


def task_result(task: Task, requests: list[Request], loglik: np.ndarray, cut: int = 0) -> dict:
    """Accuracies of ``task`` from its requests' log-likelihoods (``encode_task``'s order)."""
    n = len(task.items)
    right = right_norm = 0
    nll = 0.0  # the right continuations' negative log-likelihood per token, averaged over the items
    for item, s in zip(task.items, item_scores(task, requests, loglik)):
        right += s["pred"] == item.label
        right_norm += s["pred_norm"] == item.label
        nll -= s["loglik"][item.label] / s["tokens"][item.label]
    acc, acc_norm = right / n, right_norm / n
    return {"name": task.name, "source": task.source, "format": task.format, "fewshot": task.fewshot, "items": n,
            "acc": acc,
            "acc_stderr": stderr(acc, n), "acc_norm": acc_norm, "acc_norm_stderr": stderr(acc_norm, n),
            "chance": chance(task.items), "correct_nll": nll / n, "truncated": cut}


def report(results: list[dict]) -> str:
    """The tasks' table."""
    lines = [f"{'task':<20} {'format':<12} {'items':>6} {'acc':>15} {'acc_norm':>15} {'chance':>7} {'correct_nll':>11}"]
    for r in results:
        shots = f" {r['fewshot']}-shot" if r.get("fewshot") else ""
        lines.append(f"{(r['name'] + shots)[:20]:<20} {r['format']:<12} {r['items']:>6} "
                     f"{100 * r['acc']:>6.1f} ± {100 * r['acc_stderr']:>4.1f}% "
                     f"{100 * r['acc_norm']:>6.1f} ± {100 * r['acc_norm_stderr']:>4.1f}% {100 * r['chance']:>6.1f}% "
                     f"{r['correct_nll']:>11.4f}")
    cut = [f"{r['name']}: {r['truncated']}" for r in results if r["truncated"]]
    if cut:
        lines.append(f"contexts cut from the left to fit the window: {', '.join(cut)} choices")
    return "\n".join(lines)
