"""Flags for the tiny model the trainer tests run in seconds on a 2-core box (shared so they stay alike)."""

TINY_MODEL = ("--model.hidden_size 32 --model.num_layers 2 --model.num_heads 2 --model.num_kv_heads 1 "
              "--model.ffn_hidden_size 64 --model.moe_ffn_hidden_size 32 --model.max_seq_len 32 --train.seq_len 32 "
              "--batch-size 4 --eval.sequences 8 --eval.every 0 --log.tensorboard false --log.every 1000").split()
