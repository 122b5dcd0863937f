"""moekit-prepare (train/prepare.py) and the trainer's data formats: prepared sets, raw nanoGPT .bin, .npy,
the model vocabulary from the data's metadata, and the tokenizer record of a run directory.

Fresh random documents each run (the seed is printed on failure); a tiny BPE tokenizer trained here with
``tokenizers`` (no hub). Prepared ids must equal the tokenizer's own ``encode`` of each document + EOS.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moekit.train import documents, prepare
from moekit.train.tokens import read_token_file
from moekit.train.loop import main as train_main
from moekit.train.prepare import main
from tests.tiny import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|doc_end|>"]
WORDS_ALPHABET = list("abcdefghijklmnopqrstuvwxyz") + ["é", "ß", "ж", "中", "🙂", "ø"]


def one_error(capsys, rc: int, expected: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(("prepare.py: error: ", "train.py: error: ")), err
    assert expected in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(folder, documents, tokenizer.json path): random documents and a BPE tokenizer trained on them."""
    seed = secrets.randbits(32)
    print(f"test_prepare corpus seed {seed}")  # shown by pytest when a test fails
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(WORDS_ALPHABET, size=rng.integers(1, 8))) for _ in range(60)]

    def doc(lines: bool) -> str:
        n = int(rng.integers(3, 120))
        seps = rng.choice([" ", " ", " ", "\n", ", "] if lines else [" ", " ", ", "], size=n)
        return "".join(w + s for w, s in zip(rng.choice(words, size=n), seps)).strip()

    docs = [doc(lines=True) for _ in range(150)]
    docs[7] = f"before {SPECIALS[0]} after"  # a special token's text inside a document stays text
    folder = tmp_path_factory.mktemp("corpus")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    (folder / "tok").mkdir()
    tok.save(str(folder / "tok" / "tokenizer.json"))
    return folder, docs, folder / "tok" / "tokenizer.json"


def reference(tokenizer_json: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True  # documents are plain text
    return tok


def expected(tok: Tokenizer, docs: list[str], eos: int | None) -> list[int]:
    ids: list[int] = []
    for d in docs:
        if d and d.strip():
            ids += tok.encode(d, add_special_tokens=False).ids + ([] if eos is None else [eos])
    return ids


def read(out: Path) -> tuple[list[int], dict]:
    tokens, vocab = read_token_file(str(out))
    meta = json.loads(Path(f"{out}.json").read_text())
    assert meta["vocab_size"] == vocab
    return tokens.tolist(), meta


def write_inputs(folder: Path, kind: str, docs: list[str]) -> list[str]:
    """The documents in two files of ``kind``, plus empty documents; returns the INPUT arguments."""
    half = len(docs) // 2
    parts = [docs[:half] + ["", "  \n "], docs[half:]]
    folder.mkdir()
    if kind == "text":
        for i, part in enumerate(parts):
            for j, d in enumerate(part):
                (folder / f"{i}_{j:04d}.txt").write_text(d, encoding="utf-8")
        return [str(folder / "0_*.txt"), str(folder / "1_*.txt")]
    if kind == "lines":
        for i, part in enumerate(parts):
            (folder / f"{i}.txt").write_text("".join(d + "\n" for d in part), encoding="utf-8")
        return [str(folder / "0.txt"), str(folder / "1.txt")]
    if kind == "jsonl":
        for i, part in enumerate(parts):
            rows = [json.dumps({"id": j, "body": d}) for j, d in enumerate(part)] + ["", json.dumps({"body": None})]
            (folder / f"{i}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
        return [str(folder / "*.jsonl")]
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i, part in enumerate(parts):
        pq.write_table(pa.table({"id": list(range(len(part))), "body": part}), folder / f"{i}.parquet",
                       row_group_size=37)
    return [str(folder / "0.parquet"), str(folder / "1.parquet")]


@pytest.mark.parametrize("kind", ["text", "lines", "jsonl", "parquet"])
def test_prepared_ids_are_the_tokenizers_own(corpus, tmp_path, kind):
    if kind == "parquet":
        pytest.importorskip("pyarrow")
    folder, docs, tokenizer = corpus
    if kind == "lines":
        docs = [d.replace("\n", " ") for d in docs]
    inputs = write_inputs(tmp_path / "in", kind, docs)
    out = tmp_path / "out" / "set.bin"
    flags = ["--docs-per-line"] if kind == "lines" else ["--field", "body"] if kind in ("jsonl", "parquet") else []
    assert main([*inputs, "--tokenizer", str(tokenizer), "-o", str(out), "--workers", "1", *flags]) == 0
    tok = reference(tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    ids, meta = read(out)
    want = expected(tok, docs, eos)
    assert ids == want
    assert ids.count(eos) == len(docs)  # exactly one EOS per document: the literal "<|endoftext|>" stayed text
    # "" and "  \n " (two lines of whitespace with --docs-per-line), and a null field in each JSONL file
    empty = {"text": 2, "lines": 3, "jsonl": 4, "parquet": 2}[kind]
    assert (meta["documents"], meta["empty_documents"], meta["tokens"]) == (len(docs), empty, len(want))
    assert meta["text_bytes"] == sum(len(d.encode("utf-8")) for d in docs)
    assert meta["eos_id"] == eos and meta["vocab_size"] == tok.get_vocab_size() == 400
    digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    assert meta["tokenizer"] == {"kind": "hf", "source": str(tokenizer), "sha256": digest,
                                 "file": "set.bin.tokenizer.json"}
    assert (out.parent / "set.bin.tokenizer.json").read_bytes() == tokenizer.read_bytes()
    assert meta["field"] == ("body" if kind in ("jsonl", "parquet") else None)
    assert len(meta["inputs"]) == (len(docs) + 2 if kind == "text" else 2) and meta["dtype"] == "uint16"
    assert not list(out.parent.glob("*.partial"))


def test_workers_write_the_same_file_in_input_order(corpus, tmp_path, monkeypatch):
    folder, docs, tokenizer = corpus
    inputs = write_inputs(tmp_path / "in", "jsonl", docs)
    monkeypatch.setattr(documents, "CHUNK_DOCS", 7)  # many chunks in flight across the processes
    one, two = tmp_path / "one.bin", tmp_path / "two.bin"
    for out, workers in ((one, "1"), (two, "2")):
        assert main([*inputs, "--field", "body", "--tokenizer", str(tokenizer.parent), "-o", str(out),
                     "--workers", workers, "--quiet"]) == 0
    assert one.read_bytes() == two.read_bytes()
    assert read(one)[1]["tokens"] == read(two)[1]["tokens"]


def test_eos_choice(corpus, tmp_path):
    folder, docs, tokenizer = corpus
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(d.replace("\n", " ") for d in docs[:20]) + "\n", encoding="utf-8")
    lines = src.read_text(encoding="utf-8").splitlines()
    tok = reference(tokenizer)
    # a checkpoint folder whose tokenizer_config.json names its eos_token (a dict, as transformers writes)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|doc_end|>"}}))
    cases = [([], "<|endoftext|>"), (["--eos-token", "<|pad|>"], "<|pad|>"), (["--eos-id", "2"], "<|doc_end|>"),
             (["--no-eos"], None)]
    for i, (flags, eos_token) in enumerate(cases):
        out = tmp_path / f"eos{i}.bin"
        argv = [str(src), "--docs-per-line", "--tokenizer", str(tokenizer), "-o", str(out), "--quiet", *flags]
        assert main(argv) == 0
        eos = None if eos_token is None else tok.token_to_id(eos_token)
        ids, meta = read(out)
        assert ids == expected(tok, lines, eos) and meta["eos_id"] == eos, flags
    out = tmp_path / "folder.bin"
    assert main([str(src), "--docs-per-line", "--tokenizer", str(ckpt), "-o", str(out), "--quiet"]) == 0
    ids, meta = read(out)
    assert meta["eos_id"] == tok.token_to_id("<|doc_end|>") and ids == expected(tok, lines, meta["eos_id"])
    assert meta["tokenizer"]["source"] == str(ckpt)


def test_bytes_tokenizer(tmp_path):
    docs = ["héllo wörld\n", "second 🙂 doc", "   ", "third"]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d, encoding="utf-8")
    inputs = [str(tmp_path / f"{i}.txt") for i in range(len(docs))]
    assert main([*inputs, "--tokenizer", "bytes", "-o", str(tmp_path / "b.bin"), "--quiet"]) == 0
    ids, meta = read(tmp_path / "b.bin")
    want = [x for d in docs if d.strip() for x in [*d.encode("utf-8"), 256]]
    assert ids == want and (meta["vocab_size"], meta["eos_id"], meta["empty_documents"]) == (257, 256, 1)
    assert meta["tokenizer"] == {"kind": "bytes", "source": "bytes", "sha256": None, "file": None}
    assert not (tmp_path / "b.bin.tokenizer.json").exists()
    assert main([*inputs, "--tokenizer", "bytes", "--no-eos", "-o", str(tmp_path / "n.bin"), "--quiet"]) == 0
    ids, meta = read(tmp_path / "n.bin")
    assert ids == [x for d in docs if d.strip() for x in d.encode("utf-8")] and meta["vocab_size"] == 256
    assert meta["eos_id"] is None


def test_bpe_trained_on_the_inputs(corpus, tmp_path, capsys):
    """--tokenizer bpe:N trains a byte-level BPE on the inputs (no download): N ids, EOS <|endoftext|> = 0,
    saved beside the output; the prepared ids are that tokenizer's own encode of each document + EOS."""
    folder, docs, _ = corpus
    inputs = write_inputs(tmp_path / "in", "lines", docs)
    vocab = int(np.random.default_rng().integers(300, 600))
    out = tmp_path / "bpe" / "t.bin"  # a folder that does not exist yet
    assert main([*inputs, "--docs-per-line", "--tokenizer", f"bpe:{vocab}", "-o", str(out), "--quiet"]) == 0
    ids, meta = read(out)
    tok = reference(Path(f"{out}.tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 0 and meta["eos_id"] == 0
    assert tok.get_vocab_size() <= vocab and meta["vocab_size"] == tok.get_vocab_size()
    lines = [ln for f in inputs for ln in Path(f).read_text(encoding="utf-8").splitlines()]
    assert ids == expected(tok, lines, 0)
    assert meta["tokenizer"]["source"].startswith("bpe:") and not list(out.parent.glob("*.partial"))
    assert tok.decode(ids[: ids.index(0)]) == next(ln for ln in lines if ln.strip())  # byte-level: lossless
    for bad in ("bpe:12", "bpe:x"):
        one_error(capsys, main([*inputs, "--tokenizer", bad, "-o", str(tmp_path / "x.bin")]), "vocabulary size")
    one_error(capsys, main([*inputs, "--tokenizer", "bpe:400", "--no-eos", "-o", str(tmp_path / "x.bin")]), "id 0")
    assert not (tmp_path / "x.bin").exists()


def test_embedded_corpus_as_input(tmp_path):
    """@embedded: the trainer's embedded corpus, one document per stdlib module, byte tokens + EOS."""
    from moekit.train.tokens import embedded_corpus_files

    files = embedded_corpus_files()
    assert main(["@embedded", "--tokenizer", "bytes", "-o", str(tmp_path / "e.bin"), "--quiet"]) == 0
    ids, meta = read(tmp_path / "e.bin")
    assert meta["documents"] == len(files) and ids.count(256) == len(files)
    first = Path(files[0]).read_bytes()
    assert ids[: len(first)] == list(first) and ids[len(first)] == 256


# ---------------------------------------------------------------------------------------------------
# Training on prepared sets, raw .bin, .npy; the run directory's tokenizer record
# ---------------------------------------------------------------------------------------------------


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def train(run: Path, *flags: str) -> int:
    return train_main([*TINY_MODEL, "--steps", "2", "--checkpoint.every", "0", "--run-dir", str(run), *flags])


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    """A prepared set (hf tokenizer, vocab 400) and the run trained on it."""
    folder, docs, tokenizer = corpus
    out = tmp_path_factory.mktemp("prepared") / "train.bin"
    (out.parent / "docs.txt").write_text("\n".join(d.replace("\n", " ") for d in docs * 4), encoding="utf-8")
    assert main([str(out.parent / "docs.txt"), "--docs-per-line", "--tokenizer", str(tokenizer), "-o", str(out),
                 "--quiet"]) == 0
    run = out.parent / "run"
    assert train(run, "--data.path", str(out)) == 0
    return out, run


def test_prepared_set_trains_and_the_run_records_its_tokenizer(corpus, prepared, capsys):
    _, _, tokenizer = corpus
    out, run = prepared
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["vocab_size"] == 400  # from the set's metadata: the preset says 256
    assert (run / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    info = json.loads((run / "tokenizer_info.json").read_text())
    digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    eos = Tokenizer.from_file(str(tokenizer)).token_to_id("<|endoftext|>")
    assert info == {"kind": "hf", "source": str(tokenizer), "sha256": digest, "vocab_size": 400, "eos_id": eos}
    # a larger model vocabulary is fine; a smaller one is one line
    assert train_main([*TINY_MODEL, "--data.path", str(out), "--model.vocab_size", "512", "--print-config"]) == 0
    assert "vocab_size = 512" in capsys.readouterr().out
    one_error(capsys, train(run.parent / "small", "--data.path", str(out), "--model.vocab_size", "300"),
              "its tokenizer has vocab_size 400 (metadata")
    assert not (run.parent / "small").exists()


def test_fresh_byte_run_replaces_a_stale_tokenizer(prepared, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(prepared[1], run)
    assert (run / "tokenizer.json").exists()
    assert train(run, "--steps", "1", "--overwrite") == 0  # the embedded corpus: byte tokens
    assert not (run / "tokenizer.json").exists()
    assert json.loads((run / "tokenizer_info.json").read_text()) == {
        "kind": "bytes", "source": "bytes", "sha256": None, "vocab_size": 256, "eos_id": None}


def test_raw_bin_and_npy_train_like_the_token_file(prepared, tmp_path, capsys):
    out, run = prepared
    ids = np.asarray(read_token_file(str(out))[0])
    raw = tmp_path / "train.bin"
    np.array(ids, dtype=np.uint16).tofile(raw)  # as nanoGPT's prepare.py writes it
    # no metadata: the preset's vocabulary must hold the ids, one line says what to set
    one_error(capsys, train(tmp_path / "r0", "--data.path", str(raw)),
              f"data file {raw}: bad magic")
    assert train(tmp_path / "raw", "--data.path", str(raw), "--model.vocab_size", "400") == 0
    assert losses(tmp_path / "raw") == losses(run)  # the same ids, the same model: bitwise the same run
    assert json.loads((tmp_path / "raw" / "tokenizer_info.json").read_text())["kind"] == "unknown"
    assert not (tmp_path / "raw" / "tokenizer.json").exists()
    wide = tmp_path / "wide.bin"
    np.array(ids, dtype=np.uint32).tofile(wide)
    assert train(tmp_path / "wide", "--data.path", str(wide), "--data.dtype", "uint32",
                 "--model.vocab_size", "400") == 0
    assert losses(tmp_path / "wide") == losses(run)
    npy = tmp_path / "train.npy"
    np.save(npy, ids.astype(np.int32))
    # hand-written metadata beside it: the vocabulary (and EOS) come from there
    Path(f"{npy}.json").write_text(json.dumps({"vocab_size": 400, "eos_id": 0}))
    assert train(tmp_path / "npy", "--data.path", str(npy)) == 0
    assert losses(tmp_path / "npy") == losses(run)
    assert json.loads((tmp_path / "npy" / "tokenizer_info.json").read_text())["eos_id"] == 0


def test_bad_data_formats(tmp_path, capsys):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(bytes(101))
    one_error(capsys, train(tmp_path / "r", "--data.path", str(odd)), "not a whole, non-zero number of 2-byte ids")
    two_d = tmp_path / "m.npy"
    np.save(two_d, np.zeros((4, 4), dtype=np.int64))
    one_error(capsys, train(tmp_path / "r", "--data.path", str(two_d)), "one non-empty dimension of integer token ids")
    neg = tmp_path / "neg.npy"
    np.save(neg, np.array([1, 2, -3] * 400, dtype=np.int16))
    one_error(capsys, train(tmp_path / "r", "--data.path", str(neg)), "token id -3 at position 2 is negative")
    one_error(capsys, train(tmp_path / "r", "--data.path", str(odd), "--data.dtype", "int8"), "--data.dtype='int8'")
    meta = tmp_path / "odd.bin.json"
    meta.write_text("{oops")
    one_error(capsys, train(tmp_path / "r", "--data.path", str(odd)), "its metadata")
    meta.write_text(json.dumps({"vocab_size": 300, "tokenizer": {"kind": "hf", "file": "gone.json"}}))
    one_error(capsys, train(tmp_path / "r", "--data.path", str(odd)), "gone.json cannot be read")
    assert not (tmp_path / "r").exists()


def test_replaced_tokenizer_is_refused(prepared, tmp_path, capsys):
    import shutil

    out = tmp_path / "train.bin"
    for suffix in ("", ".json", ".tokenizer.json"):
        shutil.copy(f"{prepared[0]}{suffix}", f"{out}{suffix}")
    Path(f"{out}.tokenizer.json").write_text("{}")
    one_error(capsys, train(tmp_path / "r", "--data.path", str(out)), "the tokenizer was replaced")


# ---------------------------------------------------------------------------------------------------
# Bad input to moekit-prepare: one line, exit 2, nothing written
# ---------------------------------------------------------------------------------------------------


def test_bad_inputs(corpus, tmp_path, capsys):
    folder, docs, tokenizer = corpus
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"content": "x", "id": 1}) + "\n")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"text": \n')
    bad_utf8_json = tmp_path / "b8.jsonl"
    bad_utf8_json.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    number = tmp_path / "n.jsonl"
    number.write_text('{"text": 5}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": "  "}) + "\n")
    garbage = tmp_path / "g.parquet"
    garbage.write_bytes(b"not parquet at all")
    invalid_tok = tmp_path / "bad_tok.json"
    invalid_tok.write_text('{"model": 3}')
    no_eos = tmp_path / "noeos.json"
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.train_from_iterator(docs[:5], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    plain.save(str(no_eos))
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "afile").write_text("x")
    tok = str(tokenizer)
    out = str(tmp_path / "o" / "out.bin")
    cases = [
        ([str(good), "--tokenizer", tok], "the first record has no field 'text'; its fields: 'content', 'id'"),
        ([str(latin1), "--tokenizer", tok], f"input {latin1}: not UTF-8 text (byte 0xe9 at offset 3)"),
        ([str(bad_json), "--tokenizer", tok], f"input {bad_json} line 2: invalid JSON"),
        ([str(bad_utf8_json), "--tokenizer", tok], f"input {bad_utf8_json} line 2: not UTF-8"),
        ([str(number), "--tokenizer", tok], "field 'text' is a number, not a string"),
        ([str(empty), "--tokenizer", tok], "no documents to tokenize"),
        ([str(good), "--tokenizer", str(tmp_path / "missing.json")], "no such file or folder"),
        ([str(good), "--tokenizer", str(invalid_tok)], "not a valid tokenizer.json"),
        ([str(good), "--tokenizer", str(tmp_path / "emptydir")], "the folder holds no tokenizer.json"),
        ([str(good), "--tokenizer", str(no_eos)], "found no end-of-document token"),
        ([str(good), "--tokenizer", tok, "--eos-token", "<nope>"], "--eos-token '<nope>': not a token"),
        ([str(good), "--tokenizer", tok, "--eos-id", "99999"], "--eos-id 99999: not an id"),
        ([str(good), "--tokenizer", "bytes", "--eos-token", "x"], "--tokenizer bytes: the end-of-document id is 256"),
        ([str(tmp_path / "nope.txt"), "--tokenizer", tok], "no such file"),
        ([str(tmp_path / "*.nothing"), "--tokenizer", tok], "the pattern matches no file"),
        ([str(tmp_path / "emptydir"), "--tokenizer", tok], "is a folder"),
        ([str(good), str(tmp_path / "*.jsonl"), "--tokenizer", tok], "named twice"),
        ([str(good), "--tokenizer", tok, "--workers", "0"], "--workers 0: must be at least 1"),
        ([str(good), "--tokenizer", tok, "--bogus"], "unrecognized arguments: --bogus"),
    ]
    has_pyarrow = importlib.util.find_spec("pyarrow") is not None  # the test extra has it
    cases.append(([str(garbage), "--tokenizer", tok],
                  f"input {garbage}: not a Parquet file" if has_pyarrow else "reading Parquet needs pyarrow"))
    for argv, message in cases:
        one_error(capsys, main([*argv, "-o", out]), message)
    # unwritable output: a folder in the way, or a file where a folder should be
    one_error(capsys, main([str(latin1), "--tokenizer", "bytes", "-o", str(tmp_path / "emptydir")]),
              "a directory; name the token file to write")
    one_error(capsys, main([str(latin1), "--tokenizer", "bytes", "-o", ""]), "--output '': empty")
    one_error(capsys, main([str(latin1), "--tokenizer", "bytes", "--field", "body", "-o", out]),
              "--field 'body' names a JSONL key or Parquet column, but the inputs are plain text")
    one_error(capsys, main([str(latin1), "--tokenizer", "bytes", "-o", str(tmp_path / "afile" / "x.bin")]),
              "cannot write it")
    assert not (tmp_path / "o").exists()  # nothing left behind, not even the folder made for the output


def test_input_that_disappears(corpus, tmp_path, capsys, monkeypatch):
    _, _, tokenizer = corpus
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one")
    b.write_text("two")
    real = prepare.expand_inputs

    def listed_then_removed(patterns):
        files = real(patterns)
        b.unlink()  # gone between listing and reading
        return files

    monkeypatch.setattr(prepare, "expand_inputs", listed_then_removed)
    out = tmp_path / "out.bin"
    one_error(capsys, main([str(a), str(b), "--tokenizer", str(tokenizer), "-o", str(out)]),
              f"input {b}: cannot read it (No such file or directory): it disappeared")
    assert not list(tmp_path.glob("out.bin*"))


def test_scripts_run_without_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "prepare.py"), str(tmp_path / "none.txt"),
                           "--tokenizer", "bytes", "-o", str(tmp_path / "x.bin")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"prepare.py: error: input {tmp_path / 'none.txt'}: no such file"]
    doc = tmp_path / "d.txt"
    doc.write_text("hello")
    proc = subprocess.run([sys.executable, "-m", "moekit.train.prepare", str(doc), "--tokenizer", "bytes", "-o",
                           str(tmp_path / "d.bin"), "--workers", "2"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and read(tmp_path / "d.bin")[0] == [*b"hello", 256]


def test_console_script_help():
    exe = Path(sys.executable).parent / "moekit-prepare"
    if not exe.exists():
        pytest.skip(f"moekit-prepare is not installed next to {sys.executable}")
    proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: moekit-prepare" in proc.stdout, proc.stderr


def test_interruptible_work_hands_back_its_result_and_its_error():
    """BPE training runs in a helper thread (so Ctrl-C reaches the main thread at once): its effects and its
    exceptions come back to the caller."""
    from moekit.train.prepare_tokenizer import interruptible

    done = []
    interruptible(lambda: done.append(threading.current_thread().name))
    assert done == ["moekit-prepare-work"]

    def fail():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        interruptible(fail)


def test_more_workers_than_cpus_are_capped_with_a_note(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    _, docs, _ = corpus
    src = tmp_path / "a.txt"
    src.write_text(docs[0])
    assert main([str(src), "--tokenizer", "bytes", "-o", str(tmp_path / "o.bin"), "--workers", "64"]) == 0
    assert "--workers 64 is more than the 1 CPU(s) available; using 1" in capsys.readouterr().err
