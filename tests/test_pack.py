"""moekit-prepare --chat --pack N: whole conversations in sequences of N tokens (best fit, EOS padding of mask 0), so
that training at --train.seq_len N never cuts one; the trainer reads a packed set's windows at multiples of N."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moekit.train.chat_data import Packer
from moekit.train.data import counted
from moekit.train.prepare import main as prepare
from moekit.train.tokens import read_token_file
from tests.test_chat_prepare import chat_tokenizer, write_jsonl  # noqa: F401 - the fixture, by name

EOS = 9


def conversations(rng, n: int, longest: int, shortest: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random conversations as the chat encoder gives them: ids without EOS inside, then EOS (mask 0)."""
    out = []
    for _ in range(n):
        size = int(rng.integers(shortest, longest))
        ids = np.concatenate([rng.integers(10, 50, size), [EOS]]).astype(np.uint32)
        mask = np.concatenate([rng.integers(0, 2, size), [0]]).astype(np.uint8)
        out.append((ids, mask))
    return out


def split_at_eos(ids: np.ndarray, mask: np.ndarray) -> list[tuple[tuple, tuple]]:
    """A sequence's conversations, each up to and with its EOS; padding (lone EOS) left out."""
    out, start = [], 0
    for end in np.flatnonzero(ids == EOS):
        if end > start:
            out.append((tuple(ids[start : end + 1].tolist()), tuple(mask[start : end + 1].tolist())))
        start = end + 1
    assert start == ids.size, "a sequence must end with an EOS"
    return out


@pytest.mark.parametrize("open_limit", [1024, 3])
def test_packer_keeps_every_conversation_whole(open_limit):
    """Every conversation lands whole in exactly one sequence of exactly N tokens (ones longer than N: their first
    N - 1 tokens and an EOS of mask 0), padding is EOS of mask 0, and best fit fills most of each sequence (a few
    open sequences too, which write out their fullest early)."""
    rng = np.random.default_rng()
    N = 64
    convs = conversations(rng, 400, 40) + conversations(rng, 5, 3 * N, shortest=N)  # a few longer than N
    packer = Packer(N, EOS, open_limit=open_limit)
    seqs = [s for ids, mask in convs for s in packer.add(ids, mask)] + list(packer.finish())
    assert all(ids.size == mask.size == N for ids, mask in seqs)
    got = sorted(c for ids, mask in seqs for c in split_at_eos(ids, mask))
    want = []
    for ids, mask in convs:
        if ids.size > N:
            ids, mask = np.append(ids[: N - 1], EOS), np.append(mask[: N - 1], 0)
        want.append((tuple(ids.tolist()), tuple(mask.tolist())))
    assert got == sorted(want)
    assert packer.cut == sum(ids.size > N for ids, _ in convs) > 0 and packer.sequences == len(seqs)
    content = sum(len(ids) for ids, _ in want)
    assert packer.pad == len(seqs) * N - content  # what is not a conversation is padding
    for ids, mask in seqs:
        assert not mask[ids == EOS].any()  # EOS, padding included, is never a target
    if open_limit > 100:
        assert packer.pad / (len(seqs) * N) < 0.1, packer.pad / (len(seqs) * N)


def test_bad_pack_length_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        Packer(1, EOS)


WORDS = "What is two plus two four Name a colour blue the sky's Another one green like grass".split()


def chats(rng, n: int) -> list[list[dict]]:
    def text(k):
        return " ".join(rng.choice(WORDS, k))

    return [[{"role": "user", "content": text(int(rng.integers(1, 3)))},
             {"role": "assistant", "content": text(int(rng.integers(1, 4)))}] for _ in range(n)]


def test_a_packed_chat_set_trains_every_reply_whole(chat_tokenizer, tmp_path, capsys, monkeypatch):  # noqa: F811
    """Prepared with --pack 32, every training window at --train.seq_len 32 starts after an EOS, so the loss counts
    every reply token of the windows (the same conversations unpacked lose the replies of those windows cut); the
    trainer trains it, at a multiple of 32 too, and refuses a length that would cut its conversations."""
    from moekit.train.loop import main
    from tests.tiny import TINY_MODEL

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rng = np.random.default_rng()
    src = write_jsonl(tmp_path / "chat.jsonl", chats(rng, 300))
    for name, extra in (("packed", ["--pack", "32"]), ("plain", [])):
        assert prepare([str(src), "--chat", "--tokenizer", str(chat_tokenizer), "-o", str(tmp_path / f"{name}.bin"),
                        *extra]) == 0
    said = capsys.readouterr().out
    assert "packed 300 conversations into " in said and "--train.seq_len 32" in said
    meta = json.loads((tmp_path / "packed.bin.json").read_text())
    ids = np.asarray(read_token_file(str(tmp_path / "packed.bin"))[0], dtype=np.int64)
    mask = np.fromfile(tmp_path / "packed.bin.mask", dtype=np.uint8)
    eos = meta["eos_id"]
    assert meta["packed"] == 32 and ids.size % 32 == 1 and ids[-1] == eos and mask.size == ids.size
    assert meta["trained_tokens"] == int(mask.sum())
    plain = np.asarray(read_token_file(str(tmp_path / "plain.bin"))[0], dtype=np.int64)
    plain_mask = np.fromfile(tmp_path / "plain.bin.mask", dtype=np.uint8)
    assert meta["cut_conversations"] == 0, "the test's conversations are meant to fit"
    assert int(plain_mask.sum()) == int(mask.sum())  # the same replies
    assert (ids == eos).sum() - meta["pad_tokens"] - 1 == (plain == eos).sum()  # one EOS per conversation
    starts = np.arange((ids.size - 1) // 32) * 32
    windows = mask[starts[:, None] + 1 + np.arange(32)[None, :]] != 0
    assert (counted(ids, mask, starts, 32, eos) == windows).all()  # nothing a window began inside
    plain_starts = np.arange((plain.size - 1) // 32) * 32
    plain_windows = plain_mask[plain_starts[:, None] + 1 + np.arange(32)[None, :]] != 0
    assert counted(plain, plain_mask, plain_starts, 32, eos).sum() < plain_windows.sum()  # cut replies lost

    common = [*TINY_MODEL, "--data.path", str(tmp_path / "packed.bin"), "--data.val_fraction", "0.25", "--steps", "2",
              "--checkpoint.every", "0", "--log.progress", "off"]
    capsys.readouterr()
    for seq, masked in (("32", "false"), ("64", "true")):
        run = tmp_path / f"run{seq}"
        assert main([*common, "--model.max_seq_len", seq, "--train.seq_len", seq, "--data.document_mask", masked,
                     "--run-dir", str(run)]) == 0
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert all(0 < r["loss_tokens"] < 4 * int(seq) for r in rows)
        # without document masking, the run says that conversations see each other
        assert ("--data.document_mask true keeps every conversation" in capsys.readouterr().out) == (masked == "false")
    capsys.readouterr()
    assert main([*common, "--train.seq_len", "24", "--run-dir", str(tmp_path / "run24")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "packed for sequences of 32 tokens" in err[0] and "--train.seq_len 24" in err[0], err


def test_bad_pack_flags_and_metadata_get_one_line(chat_tokenizer, tmp_path, capsys, monkeypatch):  # noqa: F811
    from moekit.train.loop import main
    from tests.tiny import TINY_MODEL

    src = write_jsonl(tmp_path / "chat.jsonl", chats(np.random.default_rng(), 40))
    for extra, words in ((["--pack", "32"], "it needs --chat"), (["--chat", "--pack", "1"], "at least 2 tokens")):
        assert prepare([str(src), "--tokenizer", str(chat_tokenizer), "-o", str(tmp_path / "x.bin"), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
        assert not (tmp_path / "x.bin").exists()
    out = tmp_path / "p.bin"
    assert prepare([str(src), "--chat", "--pack", "32", "--tokenizer", str(chat_tokenizer), "-o", str(out),
                    "--quiet"]) == 0
    meta_path = tmp_path / "p.bin.json"
    meta = json.loads(meta_path.read_text())
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for bad in (7, 0, "32"):
        meta_path.write_text(json.dumps({**meta, "packed": bad}))
        assert main([*TINY_MODEL, "--data.path", str(out), "--steps", "1", "--run-dir", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"says packed {bad!r}" in err[0] and "prepare the set again" in err[0], err
