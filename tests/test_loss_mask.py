"""Loss masks (supervised fine-tuning: the loss counts the replies, not the prompts): a set's metadata names a file of
one byte per token. The targets it leaves out are ignored, and a step's loss is the mean over all its counted
targets however they fall on micro-batches and ranks: accumulation, data, context and pipeline parallelism give the
one-process losses. Validation and moekit-eval count the same targets, and a bad mask file gets one line."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moekit.models.loss import IGNORE_INDEX, chunked_lm_loss
from moekit.train.data import counted_targets, gather
from moekit.train.loop import main
from moekit.train.tokens import read_token_file
from tests.tiny import TINY_MODEL, byte_sets

S = 32  # TINY_MODEL's train.seq_len


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def add_mask(path: Path, mask: np.ndarray) -> None:
    """Give the prepared set ``path`` the loss mask ``mask`` (its metadata names the file)."""
    mask.astype(np.uint8).tofile(path.with_name(path.name + ".mask"))
    meta_path = path.with_name(path.name + ".json")
    meta = json.loads(meta_path.read_text())
    meta["loss_mask"] = path.name + ".mask"
    meta_path.write_text(json.dumps(meta))


def conversation_mask(ids: np.ndarray, eos: int, rng) -> np.ndarray:
    """Each document (up to its EOS) a prompt (0) then a reply (1) of random lengths, as a chat set's: windows and
    micro-batches count unequal numbers of targets."""
    out, start = np.zeros(ids.size, np.uint8), 0
    for end in np.flatnonzero(ids == eos):
        split = start + int(rng.integers(0, max(end - start, 1)))
        out[split:end] = 1  # the reply; the EOS stays 0
        start = end + 1
    return out


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mask")
    byte_sets(folder, [("t", 30_000, "abcdefgh ij\n", []), ("v", 6_000, "abcdefgh ij\n", [])])
    rng = np.random.default_rng()
    for name in "tv":
        ids = np.asarray(read_token_file(str(folder / f"{name}.bin"))[0])
        add_mask(folder / f"{name}.bin", conversation_mask(ids, 256, rng))  # bytes: EOS 256
    return folder


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def reference_keep(ids: np.ndarray, mask: np.ndarray, s: int, eos: int) -> list[bool]:
    """The targets of the window at ``s`` the loss counts, one by one: the mask's, except those of a document that
    began before the window (up to its first end-of-document)."""
    window = ids[s : s + S + 1].tolist()
    cut = s > 0 and ids[s - 1] != eos
    first = window.index(eos) if eos in window else S + 1
    return [bool(mask[s + 1 + j]) and not (cut and j < first) for j in range(S)]


def test_a_window_does_not_train_the_rest_of_a_conversation_it_cut():
    """The picture in moekit.train.data.counted: a window that begins inside a document counts none of that
    document's targets (up to its EOS), then what the mask says."""
    from moekit.train.data import counted

    E = 9
    #                 0  1  2  3  4  5  6  7  8  9 10 11 12 13
    ids = np.array([5, 1, 1, E, 2, 2, 3, 3, E, 2, 3, 3, 3, E])
    mask = np.array([0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0], np.uint8)  # replies: 1
    starts = np.array([1, 3, 0])  # inside the first document, at an EOS (the next one starts after it), the start
    got = counted(ids, mask, starts, 5, E)  # windows of S = 5
    assert got.tolist() == [[False, False, False, False, True],  # 1 1 E | 2 2 3: the cut document's targets go
                            [False, False, True, True, False],  # E 2 2 3 3 E: starts after the EOS, all counted
                            [True, True, False, False, False]]  # 5 1 1 E 2 2: from the data's start
    assert counted_targets(mask, starts, 5, ids, E) == 5
    for s in range(ids.size - 5):  # the one-by-one reference, every start
        assert counted(ids, mask, np.array([s]), 5, E)[0].tolist() == [
            bool(mask[s + 1 + j]) and not (s > 0 and ids[s - 1] != E and j < list(ids[s : s + 6]).index(E)
                                           if E in ids[s : s + 6] else s > 0 and ids[s - 1] != E)
            for j in range(5)]


def test_gather_ignores_the_targets_the_mask_leaves_out_and_the_loss_can_sum_over_a_given_count():
    rng = np.random.default_rng()
    tokens, mask = rng.integers(0, 50, 400), rng.integers(0, 2, 400).astype(np.uint8)
    starts = np.array([0, 33, 200])
    x, y = gather(tokens, starts, 16, mask)
    for r, s in enumerate(starts):
        assert x[r].tolist() == tokens[s : s + 16].tolist()
        assert y[r].tolist() == [int(t) if m else IGNORE_INDEX for t, m in zip(tokens[s + 1 : s + 17],
                                                                              mask[s + 1 : s + 17])]
    assert counted_targets(mask, starts, 16) == int((y != IGNORE_INDEX).sum())
    assert counted_targets(None, starts, 16) == 48
    h, w = torch.randn(3, 16, 8, dtype=torch.float64), torch.randn(50, 8, dtype=torch.float64)
    mean = chunked_lm_loss(h, w, y, chunk=7)
    summed = F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten(), reduction="sum")
    torch.testing.assert_close(mean.double(), summed / (y != IGNORE_INDEX).sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(chunked_lm_loss(h, w, y, chunk=7, normalizer=17.5).double(), summed / 17.5,
                               rtol=1e-6, atol=0)


def test_every_layout_and_accumulation_give_the_one_process_losses(sets, tmp_path):
    """Micro-batches and ranks count different numbers of targets: a per-micro-batch mean would weight them
    wrongly. One process with one micro-batch, with 4 (accumulation), two data ranks, context parallelism over two
    ranks and a two-stage pipeline train alike, step by step: the next-token loss and the two multi-token-prediction
    depths' (each the mean over its own counted targets, fewer the further ahead), whose gradients the later steps'
    losses also follow."""
    from tests.dist_utils import run_trainer

    common = [*TINY_MODEL, "--data.path", str(sets / "t.bin"), "--steps", "3", "--checkpoint.every", "0",
              "--log.progress", "off", "--model.aux_loss_coeff", "0",  # the aux loss of a token slice differs
              "--model.mtp_layers", "2", "--model.mtp_loss_coeff", "1.0"]
    assert main([*common, "--run-dir", str(tmp_path / "one")]) == 0
    want = rows(tmp_path / "one")
    assert all(r["loss_tokens"] < 4 * S for r in want) and any(r["loss_tokens"] for r in want)
    assert all(math.isfinite(r["mtp_loss"]) and r["mtp_loss"] > 0 for r in want)

    def same(got: list[dict], name: str) -> None:
        for key in ("mtp_loss", "loss"):
            assert [g[key] for g in got] == pytest.approx([w[key] for w in want], rel=1e-5), (name, key)
        assert [g["loss_tokens"] for g in got] == [w["loss_tokens"] for w in want]

    assert main([*common, "--train.micro_batch_size", "1", "--run-dir", str(tmp_path / "accum")]) == 0
    same(rows(tmp_path / "accum"), "accum")
    for name, extra in (("dp2", []), ("cp2", ["--cp", "2"]), ("pp2", ["--pp", "2"])):
        r = run_trainer([*common, "--run-dir", str(tmp_path / name), *extra], nproc=2)
        assert r.returncode == 0, r.stderr[-3000:]
        same(rows(tmp_path / name), name)


def test_validation_and_moekit_eval_count_the_masked_targets(sets, tmp_path):
    """The run's val_loss (a validation file with its own mask) and moekit-eval's loss equal the cross-entropy over
    the counted targets, computed here from the checkpoint."""
    from moekit.train.evaluate import main as evaluate
    from moekit.train.inference import load_for_inference

    run = tmp_path / "run"
    assert main([*TINY_MODEL, "--data.path", str(sets / "t.bin"), "--data.val_path", str(sets / "v.bin"), "--steps",
                 "2", "--checkpoint.every", "2", "--log.progress", "off", "--run-dir", str(run)]) == 0
    val = rows(run)[-1]["val_loss"]
    model, _, _ = load_for_inference(run, require_tokenizer=False, warn=lambda _m: None)
    ids = np.asarray(read_token_file(str(sets / "v.bin"))[0], dtype=np.int64)
    mask = np.fromfile(sets / "v.bin.mask", dtype=np.uint8)
    n = (ids.size - 1) // S
    starts = (np.arange(n) * S)[np.linspace(0, n - 1, 8).round().astype(int)]
    idx = starts[:, None] + np.arange(S + 1)
    eos = json.loads((sets / "v.bin.json").read_text())["eos_id"]
    windows = torch.from_numpy(ids[idx])
    keep = torch.tensor([reference_keep(ids, mask, int(s), eos) for s in starts])
    with torch.no_grad():
        logits = model(windows[:, :-1]).float()
    token_nats = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none")
    direct = (token_nats * keep.flatten()).sum().item() / keep.sum().item()
    assert val == pytest.approx(direct, rel=1e-5)
    out = tmp_path / "eval.json"
    assert evaluate([str(run), "--batches", "2", "--batch-size", "4", "--out", str(out), "--quiet"]) == 0
    got = json.loads(out.read_text())
    assert got["loss"] == pytest.approx(direct, rel=1e-5) and got["tokens"] == int(keep.sum())


def test_bad_mask_files_get_one_line(tmp_path, capsys):
    folder = tmp_path / "sets"
    folder.mkdir()
    byte_sets(folder, [("a", 3_000, "abc\n", [])])
    data = folder / "a.bin"
    size = (data.stat().st_size - 32) // 2
    cases = [(np.ones(size - 1), "bytes for"), (np.full(size, 2), "byte 2 at position 0")]
    for mask, message in cases:
        add_mask(data, mask)
        assert main([*TINY_MODEL, "--steps", "1", "--data.path", str(data), "--run-dir", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and "loss mask" in err[0], err
    data.with_name("a.bin.mask").unlink()
    assert main([*TINY_MODEL, "--steps", "1", "--data.path", str(data), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names the loss mask" in err[0] and "cannot be read" in err[0], err
    assert not (tmp_path / "r").exists()


def test_a_blend_counts_every_target_of_its_unmasked_sets(sets, tmp_path):
    """A masked set beside an unmasked one (a chat set mixed into pretraining text): the windows of the unmasked set
    count all their targets, the masked set's what its mask says."""
    import shutil

    from moekit.train.config import DataSection
    from moekit.train.data import load_data

    plain = tmp_path / "plain.bin"
    shutil.copyfile(sets / "t.bin", plain)
    meta = json.loads((sets / "t.bin.json").read_text())
    del meta["loss_mask"]
    (tmp_path / "plain.bin.json").write_text(json.dumps(meta))
    if (sets / "t.bin.tokenizer.json").exists():
        shutil.copyfile(sets / "t.bin.tokenizer.json", tmp_path / "plain.bin.tokenizer.json")
    split = load_data(DataSection(blend=f"{sets / 't.bin'}:1,{plain}:1"), 257).split(S, 0.05)
    offset = int(split.tokens.offsets[1])
    own, other = split.train_starts[split.train_starts < offset], split.train_starts[split.train_starts >= offset]
    mask = np.fromfile(sets / "t.bin.mask", dtype=np.uint8)
    assert counted_targets(split.mask, other, S) == other.size * S
    assert counted_targets(split.mask, own, S) == int(mask[own[:, None] + 1 + np.arange(S)].sum())
    _, y = gather(split.tokens, own[:3], S, split.mask)
    assert (y == IGNORE_INDEX).sum() == 3 * S - counted_targets(split.mask, own[:3], S)
