"""moekit-prepare --chat: conversations rendered with the tokenizer folder's chat template, and a loss mask over the
assistants' replies. Checked against transformers' apply_chat_template (its ids, and its assistant mask from the
same template with generation tags), trained on by moekit-train, and bad input refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moekit.train.prepare import main as prepare
from moekit.train.tokens import read_token_file

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the same layout with transformers' generation tags around each reply: its own assistant mask, the reference
TAGGED = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n"
          "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "four"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "blue, the sky's"},
     {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "green\nlike grass"}],
    [{"role": "user", "content": "a question left without a reply"}],
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("chattok")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = " ".join(m["content"] for conv in CONVERSATIONS for m in conv) + " system user assistant\n"
    tok.train_from_iterator([text] * 20, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    return folder


def write_jsonl(path: Path, conversations, field: str = "messages") -> Path:
    path.write_text("".join(json.dumps({field: c, "id": i}) + "\n" for i, c in enumerate(conversations)))
    return path


def test_ids_and_mask_are_transformers_apply_chat_template_and_its_assistant_mask(chat_tokenizer, tmp_path, capsys):
    from transformers import AutoTokenizer

    src = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    out = tmp_path / "chat.bin"
    assert prepare([str(src), "--chat", "--tokenizer", str(chat_tokenizer), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "2 conversations (1 without a reply skipped)" in said and "replies the loss counts" in said
    ids = np.asarray(read_token_file(str(out))[0], dtype=np.int64)
    mask = np.fromfile(tmp_path / "chat.bin.mask", dtype=np.uint8)
    meta = json.loads((tmp_path / "chat.bin.json").read_text())
    assert meta["loss_mask"] == "chat.bin.mask" and meta["trained_tokens"] == int(mask.sum()) and mask.size == ids.size
    ref = AutoTokenizer.from_pretrained(str(chat_tokenizer))
    eos = ref.convert_tokens_to_ids("<|endoftext|>")
    assert meta["eos_id"] == eos
    at = 0
    for conv in CONVERSATIONS[:2]:
        want = ref.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                       chat_template=TAGGED)
        n = len(want["input_ids"])
        assert ids[at : at + n].tolist() == want["input_ids"]
        assert mask[at : at + n].tolist() == want["assistant_masks"]
        assert ids[at + n] == eos and mask[at + n] == 0  # the document end is context
        at += n + 1
    assert at == ids.size
    # the replies and their end-of-turn markers, decoded from the masked tokens
    replies = ref.decode(ids[mask == 1].tolist())
    assert replies == "four<|im_end|>\nblue, the sky's<|im_end|>\ngreen\nlike grass<|im_end|>\n"


def test_a_chat_set_trains_with_its_mask(chat_tokenizer, tmp_path, monkeypatch, capsys):
    """The set trains on its replies; the tokenizer folder's special tokens and chat template travel with the set into
    the run directory, so that moekit-generate --chat answers from the run and the HF export chats as the source."""
    from transformers import AutoTokenizer

    from moekit.train.generate import main as generate
    from moekit.train.loop import main
    from tests.tiny import TINY_MODEL

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    src = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS * 60)
    assert prepare([str(src), "--chat", "--tokenizer", str(chat_tokenizer), "-o", str(tmp_path / "c.bin"),
                    "--quiet"]) == 0
    meta = json.loads((tmp_path / "c.bin.json").read_text())
    assert meta["tokenizer"]["extras"] == ["tokenizer_config.json"]
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert main([*TINY_MODEL, "--data.path", str(tmp_path / "c.bin"), "--data.val_fraction", "0.2", "--steps", "2",
                 "--checkpoint.every", "0", "--log.progress", "off", "--run-dir", str(run), "--export-hf",
                 str(hf)]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["loss_tokens"] < 4 * 32 for r in rows)  # the replies only
    assert json.loads((run / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    capsys.readouterr()
    assert generate([str(run), "--chat", "--prompt", "Name a colour.", "--max-new-tokens", "3", "--seed", "1"]) == 0
    assert "chat template" in capsys.readouterr().err
    source, exported = (AutoTokenizer.from_pretrained(str(p)) for p in (chat_tokenizer, hf))
    conv = CONVERSATIONS[1]
    assert exported.apply_chat_template(conv, tokenize=False) == source.apply_chat_template(conv, tokenize=False)
    assert exported.eos_token == "<|endoftext|>" and exported.bos_token == "<s>"
    (tmp_path / "c.bin.tokenizer_config.json").unlink()  # a listed copy gone: one line, before the run
    assert main([*TINY_MODEL, "--data.path", str(tmp_path / "c.bin"), "--run-dir", str(tmp_path / "run2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer_config.json, but its copy" in err[0] and "prepare the set again" in err[0], err


@pytest.mark.parametrize("case,message", [
    ("bytes", "--tokenizer bytes has none"),
    ("text", "not text files"),
    ("content", "message 1 needs a string role and a string content"),
    ("no-template", "has no chat template"),
    ("rewrites", "renders the conversation's earlier turns differently"),
])
def test_bad_chat_input_gets_one_line(chat_tokenizer, tmp_path, capsys, case, message):
    import shutil

    src, tok = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS[:1]), str(chat_tokenizer)
    if case == "bytes":
        tok = "bytes"
    elif case == "text":
        src = tmp_path / "notes.txt"
        src.write_text("plain text\n")
    elif case == "content":
        write_jsonl(src, [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": 4}]])
    else:
        folder = tmp_path / "tok"
        shutil.copytree(chat_tokenizer, folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        if case == "no-template":
            del config["chat_template"]
        else:  # a template that marks the last turn: earlier renderings are not prefixes of the whole
            config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        tok = str(folder)
    out = tmp_path / "out.bin"
    assert prepare([str(src), "--chat", "--tokenizer", tok, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err
    assert not out.exists() and not (tmp_path / "out.bin.mask").exists()


def test_workers_and_sharegpts_layout_give_the_same_files(chat_tokenizer, tmp_path):
    """Two worker processes write the same token and mask files as one (chunks of conversations, in order), and
    ShareGPT's {from, value} messages in its "conversations" field read as the same conversations."""
    from moekit.train import chat_data as chat

    many = CONVERSATIONS * 5  # over two chunks with CHAT_CHUNK 4
    share = [[{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
              for m in conv] for conv in many]
    write_jsonl(tmp_path / "a.jsonl", many)
    write_jsonl(tmp_path / "b.jsonl", share, field="conversations")
    outs = {}
    for name, src, extra in (("one", "a.jsonl", ["--workers", "1"]), ("two", "a.jsonl", ["--workers", "2"]),
                             ("share", "b.jsonl", ["--workers", "1", "--field", "conversations"])):
        out = tmp_path / f"{name}.bin"
        chat.CHAT_CHUNK = 4
        try:
            assert prepare([str(tmp_path / src), "--chat", "--tokenizer", str(chat_tokenizer), "-o", str(out),
                            "--quiet", *extra]) == 0
        finally:
            chat.CHAT_CHUNK = 256
        outs[name] = (out.read_bytes(), (tmp_path / f"{name}.bin.mask").read_bytes())
    assert outs["one"] == outs["two"] == outs["share"]
    assert np.frombuffer(outs["one"][1], dtype=np.uint8).sum() > 0
