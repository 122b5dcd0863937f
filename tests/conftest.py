import os

# Two-core CI box: keep intra-op threads modest so spawned ranks do not oversubscribe.
os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
