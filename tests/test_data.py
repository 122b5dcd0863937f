"""train/data.py: embedded corpus, token files and their header checks, split, sampler."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from moekit.train import UserError
from moekit.train.data import Sampler, gather, split_windows, unigram_entropy
from moekit.train.tokens import HEADER, embedded_corpus, load_tokens, read_token_file, write_token_file


@pytest.fixture(scope="module")
def corpus():
    return embedded_corpus()[0]


def test_embedded_corpus_is_deterministic_text(corpus):
    again, desc = embedded_corpus()
    assert np.array_equal(corpus, again) and corpus.dtype == np.uint8
    assert corpus.size > 1 << 20 and "stdlib" in desc
    text = corpus[:200_000].tobytes().decode("utf-8")
    assert "def " in text and "import " in text


@pytest.mark.parametrize("vocab,dtype", [(256, "<u2"), (50_000, "<u2"), (100_000, "<u4")])
def test_token_file_round_trip(tmp_path, vocab, dtype):
    tokens = np.random.default_rng(0).integers(0, vocab, size=1000)
    path = tmp_path / "t.bin"
    write_token_file(str(path), tokens, vocab)
    back, v = read_token_file(str(path))
    assert v == vocab and back.dtype == np.dtype(dtype) and np.array_equal(back, tokens)
    assert path.stat().st_size == HEADER.size + 1000 * np.dtype(dtype).itemsize


def test_write_rejects_out_of_range_ids(tmp_path):
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        write_token_file(str(tmp_path / "t.bin"), [1, 2, 10], 10)


def _raw_file(path: Path, magic=b"MOEKTOK\0", version=1, vocab=256, code=2, count=4, body=None) -> str:
    body = np.arange(count, dtype="<u2").tobytes() if body is None else body
    path.write_bytes(HEADER.pack(magic, version, vocab, code, 0, count) + body)
    return str(path)


@pytest.mark.parametrize("kwargs,match", [
    (dict(magic=b"NOTMAGIC"), "bad magic"),
    (dict(version=9), "format version 9"),
    (dict(code=3), "dtype code 3"),
    (dict(count=10, body=bytes(8)), "header says 10 tokens"),
    (dict(vocab=70_000), "does not fit its 16-bit tokens"),
    (dict(vocab=2), r"token id 2 at position 2 is >= vocab_size 2"),
])
def test_bad_token_files_name_file_and_problem(tmp_path, kwargs, match):
    path = _raw_file(tmp_path / "bad.bin", **kwargs)
    with pytest.raises(UserError, match=match) as info:
        read_token_file(path)
    assert str(path) in str(info.value)


def test_short_file_and_missing_file(tmp_path):
    short = tmp_path / "short.bin"
    short.write_bytes(b"MOEK")
    with pytest.raises(UserError, match="too short"):
        read_token_file(str(short))
    with pytest.raises(UserError, match="cannot read"):
        read_token_file(str(tmp_path / "nope.bin"))


def test_model_vocab_must_cover_the_file(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file(str(path), [1, 2, 3], 512)
    with pytest.raises(UserError, match="vocab_size 512 exceeds the model's vocab_size 256"):
        load_tokens(str(path), "", 256)
    tokens, _ = load_tokens(str(path), "", 512)
    assert list(tokens) == [1, 2, 3]


@pytest.mark.parametrize("form,metadata,fix", [
    ("raw", None, "set --model.vocab_size 1000 (or more) if the ids are right, or tokenize the data again"),
    ("npy", None, "set --model.vocab_size 1000 (or more)"),
    ("raw", 260, "declares vocab_size 260, fewer than the ids need: prepare the set again"),
    ("npy", 260, "declares vocab_size 260, fewer than the ids need: prepare the set again"),
    ("moektok", None, "its header's vocab_size understates its ids: write the file again"),
])
def test_ids_beyond_the_vocabulary_are_refused_when_the_data_opens(tmp_path, form, metadata, fix):
    """Ids the model's embedding cannot hold never reach it: a file without metadata (checked against the model's
    vocab_size), metadata declaring fewer ids than the file holds, or a token file whose header does. One check of
    the whole file at open (not per batch); the error names the file, the first bad id, the largest and the fix."""
    import json

    from moekit.train.data import load_data
    from moekit.train.config import DataSection

    ids = np.array([1, 2, 300, 5, 999] * 1000)
    path = tmp_path / ("t.npy" if form == "npy" else "t.bin")
    if form == "npy":
        np.save(path, ids.astype(np.int32))
    elif form == "raw":
        ids.astype("<u2").tofile(path)
    else:  # a token file whose header claims vocab 256 but holds 300 and 999
        write_token_file(str(path), np.ones_like(ids), 256)
        path.write_bytes(path.read_bytes()[:HEADER.size] + ids.astype("<u2").tobytes())
    if metadata:
        Path(f"{path}.json").write_text(json.dumps({"vocab_size": metadata}))
    vocab = metadata or 256
    with pytest.raises(UserError) as info:
        load_data(DataSection(path=str(path)), 1024 if metadata else 256)
    msg = str(info.value)
    assert f"data file {path}" in msg and f"token id 300 at position 2 is >= vocab_size {vocab}" in msg, msg
    assert "(the largest id is 999)" in msg and fix in msg, msg


def test_split_is_disjoint_deterministic_and_seq_len_independent(corpus):
    s = split_windows(corpus, 64, 0.05)
    seq = 64
    train_cover = set((s.train_starts[:, None] + np.arange(seq + 1)).ravel().tolist())
    val_cover = set((s.val_starts[:, None] + np.arange(seq + 1)).ravel().tolist())
    assert not train_cover & val_cover  # no token is in both splits, targets included
    assert 0.03 < s.val_starts.size / (s.val_starts.size + s.train_starts.size) < 0.07
    again = split_windows(corpus, 64, 0.05)
    assert np.array_equal(s.train_starts, again.train_starts) and np.array_equal(s.val_starts, again.val_starts)
    # the validation blocks do not depend on seq_len
    longer = split_windows(corpus, 128, 0.05)
    assert set((longer.val_starts // 16384).tolist()) == set((s.val_starts // 16384).tolist())


def test_split_small_data_and_too_small_data():
    small = np.arange(5000) % 256
    s = split_windows(small, 16, 0.1)
    assert s.val_starts.size > 0 and s.train_starts.size > 0
    with pytest.raises(UserError, match="too few"):
        split_windows(np.zeros(100, dtype=np.uint8), 64, 0.05)


def test_sampler_resumes_exactly_and_covers_each_epoch():
    starts = np.arange(0, 1000, 10)
    a = Sampler(starts, seed=3)
    first = np.concatenate([a.next(7) for _ in range(14)])  # 98 windows: not yet one epoch
    assert len(set(first.tolist())) == 98
    state = a.state_dict()
    rest_a = np.concatenate([a.next(7) for _ in range(20)])  # crosses into epoch 1
    b = Sampler(starts, seed=3)
    b.load_state_dict(state)
    rest_b = np.concatenate([b.next(7) for _ in range(20)])
    assert np.array_equal(rest_a, rest_b)
    epoch0 = np.concatenate([first, rest_a[:2]])
    assert sorted(epoch0.tolist()) == starts.tolist()  # every window exactly once per epoch
    assert not np.array_equal(Sampler(starts, seed=4).next(20), Sampler(starts, seed=3).next(20))


def test_sampler_rejects_state_of_other_data():
    a = Sampler(np.arange(10), seed=0)
    b = Sampler(np.arange(12), seed=0)
    with pytest.raises(UserError, match="same data"):
        b.load_state_dict(a.state_dict())


def test_gather_shifts_targets(corpus):
    x, y = gather(corpus, np.array([0, 100]), 8)
    assert x.shape == y.shape == (2, 8) and str(x.dtype) == "torch.int64"
    assert x[0, 1:].tolist() == y[0, :-1].tolist() and x[1, 0].item() == corpus[100]


def test_unigram_entropy():
    assert unigram_entropy(np.array([0, 1, 2, 3] * 10), 256) == pytest.approx(np.log(4))
    assert unigram_entropy(np.zeros(10, dtype=np.uint8), 256) == 0.0
    assert struct.calcsize("<8sIIIIQ") == HEADER.size == 32


def test_truncate_after_drops_a_half_written_last_line(tmp_path):
    """A crash mid-write leaves a cut line; resuming must drop it (and later steps), not crash."""
    import importlib
    records = importlib.import_module("moekit.train.records")
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"format": 1}\n{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    records.truncate_after(path, 2)
    assert path.read_text() == '{"format": 1}\n{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    records.truncate_after(path, 1)
    assert path.read_text().splitlines()[-1] == '{"step": 1, "loss": 2.0}'
