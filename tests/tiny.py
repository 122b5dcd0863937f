"""Flags for the tiny model the trainer tests run in seconds on a 2-core box (shared so they stay alike)."""

TINY_MODEL = ("--model.hidden_size 32 --model.num_layers 2 --model.num_heads 2 --model.num_kv_heads 1 "
              "--model.ffn_hidden_size 64 --model.moe_ffn_hidden_size 32 --model.max_seq_len 32 --train.seq_len 32 "
              "--batch-size 4 --eval.sequences 8 --eval.every 0 --log.tensorboard false --log.every 1000").split()


def byte_sets(folder, specs) -> None:
    """Byte-token sets of fresh random text in ``folder``, made by moekit-prepare: for each (name, characters,
    letters, extra prepare flags), ``name.bin`` of about that many characters of the letters, in lines of 60."""
    from pathlib import Path

    import numpy as np

    from moekit.train.prepare import main as prepare

    rng = np.random.default_rng()
    for name, size, letters, extra in specs:
        chars = np.array(list(letters))
        text = Path(folder) / f"{name}.txt"
        text.write_text("\n".join("".join(rng.choice(chars, size=60)) for _ in range(size // 60)))
        assert prepare([str(text), "--docs-per-line", "--tokenizer", "bytes", "-o", str(Path(folder) / f"{name}.bin"),
                        "--quiet", *extra]) == 0
