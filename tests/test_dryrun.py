"""--dry-run plans big layouts on one CPU; moekit.train.planning.memory's estimate matches memory measured on real runs."""
import dataclasses
import gc
import time
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moekit.comm.topology import Layout, Topology
from moekit.models.config import preset
from moekit.train.planning.linear_memory import new_objects_gc
from moekit.train.planning.memory import Workload, all_to_all, estimate_memory
from moekit.models.parallelize import apply_activation_checkpointing, parallelize
from moekit.models.transformer import build_model
from tests.dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[1]
from moekit.train import UserError
from moekit.train.planning import dryrun
from moekit.train.cli import parse_args

# ---------------------------------------------------------------------------------------------------
# Measuring real memory
# ---------------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class LiveStorages(TorchDispatchMode):
    """Every storage an op creates while active; ``alive()`` sums those still referenced afterwards.

    Run around a forward and keep only the loss: what is still alive is what autograd (and activation
    checkpointing) holds for backward, whoever saved it (C++ nodes, custom Functions, checkpoint inputs).
    """

    # the largest storages the last ``alive()`` counted, (bytes, op that made them): compare() shows them when an
    # estimate misses (the rare two-rank surplus once seen under worksteal was most likely gloo's late release: see alive())
    last_top: list[tuple[int, str]] = []

    def __init__(self):
        super().__init__()
        self.seen: dict[int, tuple[StorageWeakRef, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = _local(t).untyped_storage()
                old = self.seen.get(s._cdata)
                if old is None or old[0].expired():  # a freed storage's address can be reused
                    self.seen[s._cdata] = (StorageWeakRef(s), str(func))
        return out

    def alive(self, exclude, settle_s: float = 2.0) -> int:
        """Bytes of the storages still alive now (at their current size: FSDP frees unsharded parameters by
        resizing their storage to 0), except those of ``exclude``.

        Read until two readings 2 ms apart agree (at most ``settle_s``): a gloo collective's worker thread still
        holds its Work, and with it the collective's input and output tensors, for a moment after the caller's
        wait() returns (measured: after 15-25% of dist.all_gather calls on an idle 2-core box; 1 ms later, none
        under 3x CPU overload). A forward that ends shortly after a collective, on a loaded box, then counted
        those buffers as activations (test_planning_cp's deepseek tp 2 case once read 48 KiB over its
        estimate). Nothing else runs meanwhile, so the readings only fall."""
        skip = {_local(t).untyped_storage()._cdata for t in exclude}
        before, deadline = None, time.monotonic() + settle_s
        while True:
            gc.collect()  # storages only cyclic garbage holds are not activations (and would vary with GC timing)
            live = [(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes(), op)
                    for key, (ref, op) in self.seen.items() if not ref.expired() and key not in skip]
            total = sum(n for n, _ in live)
            if total == before or time.monotonic() > deadline:
                break
            before = total
            time.sleep(0.002)
        LiveStorages.last_top = sorted(live, reverse=True)[:12]
        return total


def test_alive_waits_for_a_reference_another_thread_drops_late():
    """What a background thread (gloo's worker, here a timer) still holds for a moment is not counted; what the
    caller holds is."""
    import threading

    track, keep = LiveStorages(), []
    with track:
        kept, late = torch.ones(256), torch.ones(1024)
    keep.append(late)
    threading.Timer(0.02, keep.clear).start()
    del late
    assert track.alive([]) == kept.nbytes  # 4 KiB dropped 20 ms after the call
    assert track.alive([kept]) == 0


def measure(model, tokens: torch.Tensor, targets: torch.Tensor, autocast: torch.dtype | None = None,
            backward: bool = True) -> dict[str, int]:
    """Bytes of parameters, activations kept by one forward (under CPU ``autocast`` when given), gradients,
    AdamW state after one step. ``backward=False``: parameters and activations only (no backward, no step), for
    the checks that read the activations alone (the kept bytes are measured before any backward either way)."""
    params = list(model.parameters())
    out = {"params": sum(_local(p).numel() * p.element_size() for p in params)}
    track = LiveStorages()
    with new_objects_gc():  # alive()'s collection walks the forward's objects only, not the whole test process
        with track, torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = model(tokens, targets=targets)  # as the trainer: the loss from hidden states (models.loss)
        out["activations"] = track.alive(params + list(model.buffers()) + [tokens, targets])
    if not backward:
        return out
    loss.backward()
    out["grads"] = sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)  # the trainer's optimizer
    opt.step()
    out["optimizer"] = sum(_local(v).numel() * v.element_size() for st in opt.state.values()
                           for v in st.values() if isinstance(v, torch.Tensor))
    out["total"] = sum(out.values())
    return out


def compare(measured: dict, est, tol: float = 0.2) -> dict[str, float]:
    """estimate / measured per quantity; each must be within ``tol``."""
    estimate = {"params": est.params, "grads": est.grads, "optimizer": est.optimizer,
                "activations": est.activations, "total": est.total}
    ratios = {k: estimate[k] / measured[k] for k in estimate}
    assert all(abs(r - 1) <= tol for r in ratios.values()), (ratios, measured, estimate,
                                                             {"largest live (bytes, op)": LiveStorages.last_top})
    return ratios


# ---------------------------------------------------------------------------------------------------
# The estimate against measured runs
# ---------------------------------------------------------------------------------------------------

B, S = 2, 64  # one micro-batch



def measure_one_process(cfg, mode: str, autocast=None, backward: bool = True) -> dict:
    """The memory one training forward + backward of ``cfg`` keeps (``measure``; ``backward=False``: the forward's
    activations alone), built in one process with activation checkpointing ``mode``, on B x S random tokens and
    targets (seeded)."""
    model = build_model(cfg, seed=0)
    apply_activation_checkpointing(model, mode)
    model.train()
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (B, S), generator=gen) for _ in range(2))
    return measure(model, tokens, targets, autocast=autocast, backward=backward)

@pytest.mark.parametrize("name,mode,over", [
    ("mixtral-tiny", "none", {}), ("mixtral-tiny", "ffn", {}), ("mixtral-tiny", "full", {}),
    ("deepseek-tiny", "none", {}), ("switch-tiny", "none", {}),
    ("mixtral-tiny", "none", {"activation": "gelu", "shared_ffn_hidden_size": 64, "shared_expert_gate": True}),
    ("deepseek-tiny", "none", {"mtp_layers": 2}), ("deepseek-tiny", "full", {"mtp_layers": 1}),
    # gpt-oss: sinks (CPU SDPA's math backend over widened q / k / v), a 64-wide window on layer 0 (= S: the mask
    # still exists), wo / router / expert biases, swiglu_oai through the loop's composite path
    ("gpt-oss-tiny", "none", {}), ("gpt-oss-tiny", "full", {}), ("gpt-oss-tiny", "selective", {}),
    ("gpt-oss-tiny", "ffn", {"sliding_window": 16}),
    ("mixtral-tiny", "none", {"sliding_window": 16, "full_attention_every": 2}),  # a window without sinks: its mask
    ("mixtral-tiny", "selective", {"sliding_window": 16}),
    # swiglu_oai's composite dense MLP and shared expert keep 7 F per token (ffn_widths), the routed experts 3 F
    ("deepseek-tiny", "none", {"activation": "swiglu_oai", "moe_ffn_bias": True}),
    # MLA with q wider than v (12 vs 6): CPU SDPA's math path keeps each call's softmax probabilities, no output
    # (the planner was ~6% low here before it counted them)
    ("deepseek-tiny", "none", {"attention": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                               "v_head_dim": 6, "q_lora_rank": 12}),
    # Qwen3.5: a Gated DeltaNet layer (its chunked rule counted by a fake run of the layer: 64 positions = 3 chunks of
    # 24, the last padded) and a gated GQA layer (sigmoid(gate) and the gated output)
    ("qwen3.5-tiny", "none", {"full_attention_every": 2, "linear_chunk": 24}),
    ("qwen3.5-tiny", "full", {"full_attention_every": 2}), ("qwen3.5-tiny", "selective", {"full_attention_every": 2}),
    ("qwen3.5-tiny", "ffn", {"full_attention_every": 2}),
    # Llama 4: a RoPE layer in 16-position chunks (4 SDPA calls per sequence) with the weightless q / k norm, a NoPE
    # layer (its query temperature) whose MoE weights the experts' input
    ("llama4-tiny", "none", {"attention_chunk": 16}), ("llama4-tiny", "selective", {"attention_chunk": 16}),
])
def test_estimate_matches_one_process(name, mode, over):
    cfg = dataclasses.replace(preset(name), num_layers=2, **over)
    measured = measure_one_process(cfg, mode)
    est = estimate_memory(cfg, Layout(), Workload(B, S, "float32", mode, "cpu"))
    compare(measured, est)
    # parameters, gradients and AdamW state are counted exactly; activations up to small int / scalar
    # tensors, except that with a capacity the CPU loop backend skips the rows nobody kept (an upper bound)
    assert (est.params, est.grads, est.optimizer) == (measured["params"], measured["grads"], measured["optimizer"])
    tol = 0.1 if cfg.capacity_factor is not None else 0.005
    assert est.activations == pytest.approx(measured["activations"], rel=tol), est.breakdown


@pytest.mark.parametrize("name,attention,mode", [
    ("mixtral-tiny", "auto", "none"), ("mixtral-tiny", "never", "none"),
    ("mixtral-tiny+qk", "never", "none"),  # Qwen3's q/k norms on bf16 q / k keep fp32 copies (composite RMSNorm)
    ("gpt-oss-tiny", "auto", "none"), ("gpt-oss-tiny", "never", "none"),  # explicit with a sink column; math SDPA
    # checkpointed blocks recompute their weights' bf16 casts too: only the head's (and, under ffn, attention's)
    # stay; counting every block's was 4.5x the measured bytes here
    ("mixtral-tiny", "never", "full"), ("gpt-oss-tiny", "never", "selective"), ("gpt-oss-tiny", "auto", "ffn"),
    ("qwen3.5-tiny", "auto", "none"), ("qwen3.5-tiny", "never", "selective"),
    ("llama4-tiny", "auto", "none"),  # the chunked layer runs SDPA per chunk, the NoPE one the explicit path
    # every projection reading an input keeps its own bf16 cast: the dense first layer's w_gate and w_up, the shared
    # expert's (and Qwen's gate: qwen3.5-tiny above)
    ("deepseek-tiny", "never", "none"),
])
def test_estimate_matches_one_process_under_cpu_bf16_autocast(name, attention, mode):
    """CPU bf16 autocast (``--train.dtype bfloat16``): the attention input's one bf16 copy, and the attention's
    kept tensors whichever path runs: the explicit bmm + softmax (auto at this length: it keeps the [B, N, S, S]
    probabilities) or SDPA (its output and logsumexp)."""
    from moekit.models import attention as A

    cfg = dataclasses.replace(preset(name.removesuffix("+qk")), num_layers=2)
    if name.endswith("+qk"):
        cfg.qk_norm = "head"
    if cfg.linear_attention != "none":  # one Gated DeltaNet layer, one gated GQA layer
        cfg.full_attention_every = 2
    if cfg.nope_every:  # Llama 4: chunks shorter than the sequence
        cfg.attention_chunk = 16
    before, A.EXPLICIT_ATTENTION = A.EXPLICIT_ATTENTION, attention
    try:
        assert A.explicit_attention_applies("cpu", torch.bfloat16, B, cfg.num_heads, S) == (attention == "auto")
        measured = measure_one_process(cfg, mode, autocast=torch.bfloat16, backward=False)
        est = estimate_memory(cfg, Layout(), Workload(B, S, "bfloat16", mode, "cpu"))
    finally:
        A.EXPLICIT_ATTENTION = before
    assert est.activations == pytest.approx(measured["activations"], rel=0.005), (est.breakdown, measured)


@pytest.mark.parametrize("name,mode", [("mixtral-tiny", "none"), ("gpt-oss-tiny", "none"),
                                       ("gpt-oss-tiny", "selective")])
def test_estimate_matches_one_process_with_window_blocks(monkeypatch, name, mode):
    """A sliding window runs its queries in blocks, each over the keys its window reaches (models.attention.
    local_attention; 16-query blocks here, WINDOW_BLOCK 256 by default), moved back to a multiple of 16 keys: a mask
    per block, each block's SDPA output (sinks: its widened copies), and wo's input a copy of the concatenated
    outputs. With a 6-position window the blocks after the first see 16 + 5 keys and read 32: the estimate of
    21-key masks and calls was 1.4% under the measured bytes."""
    from moekit.models import attention
    from moekit.train.planning import activations as A

    monkeypatch.setattr(attention, "WINDOW_BLOCK", 16)
    cfg = dataclasses.replace(preset(name), num_layers=2, sliding_window=6)
    wl = Workload(B, S, "float32", mode, "cpu")
    calls = A._calls(A.shapes(cfg, Layout(), wl), 0, 6)  # the planner sees the blocks too, and their keys
    assert [(n, keys, masked) for n, keys, masked in calls] == [(16, 16, True)] + [(16, 32, True)] * 3
    measured = measure_one_process(cfg, mode, backward=False)
    est = estimate_memory(cfg, Layout(), wl)
    assert est.activations == pytest.approx(measured["activations"], rel=0.005), est.breakdown


# MLA with equal q / v head dims (CPU SDPA's flash kernel; tests/test_planning_cp.py's)
MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, q_lora_rank=12)
EOS = 0  # the documents' end id (Transformer.document_eos) in the document-masking cases


def packed_tokens(cfg, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] tokens and targets, the tokens with EOS ending documents at positions 5, 20, 40 (row 0) and 30 (row 1)
    and nowhere else (ids from 1), and the targets."""
    gen = torch.Generator().manual_seed(seed)
    tokens, targets = (torch.randint(1, cfg.vocab_size, (B, S), generator=gen) for _ in range(2))
    tokens[0, [5, 20, 40]] = EOS
    tokens[1, 30] = EOS
    return tokens, targets


@pytest.mark.parametrize("name,over,mode,dtype,block", [
    # GQA: one masked call where there was causal SDPA: the [B, 1, S, S] mask per layer
    ("mixtral-tiny", {}, "none", "float32", 256),
    # sinks: the full layer's call masked too (S query rows, not the causal call's padded P'); the window's per
    # sequence
    ("gpt-oss-tiny", {"sliding_window": 6}, "none", "float32", 256),
    ("deepseek-tiny", MLA, "none", "float32", 256),  # MLA: its one call masked
    # window blocks of 16 over 32 keys (21 aligned to 16), a [B, 1, 16, keys] mask per block
    ("gpt-oss-tiny", {"sliding_window": 6}, "none", "float32", 16),
    ("mixtral-tiny", {"sliding_window": 6}, "none", "float32", 16),
    # no window: on CPU the document masks take the blocks too, each over the keys up to its end (window_block)
    ("mixtral-tiny", {}, "none", "float32", 16), ("gpt-oss-tiny", {}, "none", "float32", 16),
    # the checkpoints keep the documents [B, S] int32 as the blocks' input; selective: the sink calls' SDPA output
    # S rows long (masked) where the unmasked call's was P'
    ("mixtral-tiny", {}, "full", "float32", 256), ("gpt-oss-tiny", {}, "selective", "float32", 256),
    # CPU bf16: the explicit bmm + softmax path runs without documents, SDPA with them
    ("mixtral-tiny", {}, "none", "bfloat16", 256), ("gpt-oss-tiny", {}, "none", "bfloat16", 256),
    # Gated DeltaNet: per-chunk document masks, the starting state's reach, the convolution's masked taps
    ("qwen3.5-tiny", {"full_attention_every": 2, "linear_chunk": 16}, "none", "float32", 256),
    ("qwen3.5-tiny", {"full_attention_every": 2}, "none", "bfloat16", 256),
    # chunks of 16 cut the document-masked calls (blocks of 16 inside them: one call each)
    ("llama4-tiny", {"attention_chunk": 16}, "none", "float32", 256),
    ("llama4-tiny", {"attention_chunk": 32}, "none", "float32", 16),
])
def test_estimate_matches_one_process_with_documents(monkeypatch, name, over, mode, dtype, block):
    """Document masking (--data.document_mask; models.attention.positioned_attention): every attention call is
    masked, by a [B, 1, queries, keys] mask (a mask per sequence); checkpointed blocks keep the documents. The same
    model and tokens with and without it: the estimate's difference is the measured one to the byte, and the
    estimate is within 8 KiB above the measured bytes either way."""
    from moekit.models import attention

    monkeypatch.setattr(attention, "WINDOW_BLOCK", block)
    cfg = dataclasses.replace(preset(name), num_layers=2, **over)
    tokens, targets = packed_tokens(cfg)
    measured, est = {}, {}
    for documents in (False, True):
        model = build_model(cfg, seed=0)
        apply_activation_checkpointing(model, mode)
        model.train()
        model.document_eos = EOS if documents else None
        autocast = torch.bfloat16 if dtype == "bfloat16" else None
        measured[documents] = measure(model, tokens, targets, autocast=autocast, backward=False)["activations"]
        est[documents] = estimate_memory(cfg, Layout(), Workload(B, S, dtype, mode, "cpu", document_mask=documents))
        assert 0 <= est[documents].activations - measured[documents] <= 8192, (documents, measured, est[documents])
    print(f"{name} {mode} {dtype} block {block}: measured {measured}, estimate "
          f"{ {k: v.activations for k, v in est.items()} }")
    assert est[True].activations - est[False].activations == measured[True] - measured[False], est[True].breakdown
    # the documents also live through the loss, whose logits chunk is a transient: there unless checkpoints keep them
    transient = est[True].breakdown.get("transient_documents", 0)
    assert transient == (0 if mode in ("full", "selective") else B * S * 4)


TWO_RANK_LAYOUTS = [  # (preset, layout, activation checkpointing, sequence parallel)
    ("mixtral-tiny", Layout(dp=2, ep=2), "none", False),  # 4 of 8 experts per rank, tokens exchanged by all-to-all
    ("mixtral-tiny", Layout(dp=2, ep=2), "full", False),
    ("deepseek-tiny", Layout(tp=2), "none", False),  # heads and the dense FFN sharded, MoE tokens split over TP
    # residual, norms and MoE layers on half the sequence; attention / dense MLP save their gathered input
    ("deepseek-tiny", Layout(tp=2), "none", True),
    ("deepseek-tiny", Layout(tp=2), "full", True),  # the checkpoint keeps the first block's whole input
    ("deepseek-tiny", Layout(tp=2), "ffn", True),  # checkpoints keep the MoE's half, the dense MLP's gathered whole
    ("mixtral-tiny", Layout(fsdp=2, ep=2), "none", False),  # FSDP2: dense dim 0 over fsdp; experts EP-sharded
    # Gated DeltaNet layers over TP: each rank's heads (a layer of half the heads, run by the planner on fake tensors),
    # wz / wb / wa / wo sharded, wqkv and the convolution replicated
    ("qwen3.5-tiny", Layout(tp=2), "none", False),
    ("qwen3.5-tiny", Layout(tp=2), "none", True),
]


def _two_ranks(rank: int, world: int):
    for name, layout, mode, sp in TWO_RANK_LAYOUTS:
        cfg = dataclasses.replace(preset(name), num_layers=2)
        topo = Topology(layout, rank, ranks_per_node=2).build()
        gen = torch.Generator().manual_seed(topo.data_rank())  # each data-parallel rank reads its own tokens
        tokens, targets = (torch.randint(0, cfg.vocab_size, (B, S), generator=gen) for _ in range(2))
        model = build_model(cfg, seed=0)
        traffic = parallelize(model, topo, activation_checkpointing=mode, sequence_parallel=sp).traffic
        model.train()
        measured = measure(model, tokens, targets)
        wl = Workload(B, S, "float32", mode, "cpu", sequence_parallel=sp)
        ratios = compare(measured, estimate_memory(cfg, layout, wl, ranks_per_node=2))
        print(f"rank {rank} {name} {layout} ac={mode} sp={sp}: estimate / measured {ratios}")
        if layout.ep == 1:  # no routing imbalance between ranks: exact up to small tensors (SP saves ~10%
            assert abs(ratios["activations"] - 1) <= 0.01, ratios  # here, which 20% would not notice)
        if layout.ep > 1:  # forward all-to-all bytes (the trainer's counter) against moekit.train.planning.cost_model's expectation
            sent = sum(v for k, v in traffic.snapshot().items() if k.endswith("_intra"))
            expected = all_to_all(cfg, layout, wl, ranks_per_node=2).forward["intra"]
            assert abs(sent / expected - 1) <= 0.25, (sent, expected)


def test_estimate_matches_two_ranks():
    """Expert, tensor and fully-sharded data parallelism over gloo, one spawn for all layouts."""
    run_ranks(_two_ranks, 2)


# ---------------------------------------------------------------------------------------------------
# The dry run
# ---------------------------------------------------------------------------------------------------


def dry(capsys, *args) -> tuple[int, str, str]:
    rc = dryrun.main(["--dry-run", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_dry_run_512_ranks_mixtral(capsys):
    rc, out, err = dry(capsys, "--preset", "mixtral-8x7b", "--world-size", "512", "--ep", "8", "--batch-size", "512",
                       "--train.seq_len", "4096")
    assert rc == dryrun.DOES_NOT_FIT == 3, err  # a script or sweep sees the verdict in the exit status
    assert "on 512 ranks" in out and "64 node(s) x 8 ranks" in out
    assert "the estimate agrees" in out  # the recipe's real shards are the estimate's
    assert "does NOT fit" in out  # 7.2B fp32 parameters per rank + AdamW: 108 GiB before activations
    assert "intra-node 7.00 GiB" in out  # 32 layers x 4096 tokens x 1.75 rows x 4096 x (2 + 2) bytes x 2
    assert out.rstrip().splitlines()[-1].startswith("all-to-all per optimizer step")  # the full report, then 3
    print(out)


@pytest.mark.parametrize("gpu_gb,status,verdict", [
    (None, 0, ": fits"),  # mixtral-tiny on an 80 GiB GPU
    ("1e-4", 3, ": does NOT fit"),  # the same plan on a 100 KiB device
])
def test_dry_run_exit_status_is_the_verdict(capsys, gpu_gb, status, verdict):
    """Through the program's own entry point (moekit-train / tools/train.py): a plan that fits exits 0, one whose
    peak exceeds --dry-run-gpu-gb exits 3 after printing the whole report, so scripts need not parse it."""
    from moekit.train.loop import main

    rc = main(["--dry-run", "--world-size", "2", "--ep", "2", "--batch-size", "4"]
              + (["--dry-run-gpu-gb", gpu_gb] if gpu_gb else []))
    out = capsys.readouterr()
    assert rc == status, out.err + out.out
    assert verdict in out.out and out.err == "", out
    assert "rank 0 (pipeline rank 0" in out.out and "all-to-all per optimizer step" in out.out


def test_dry_run_counts_redundant_expert_slots(capsys, tmp_path):
    """--layout.expert_replicas 8 over ep 8: two expert slots per rank instead of one. The recipe builds the
    run's placement (its shards double the experts) and the estimate counts the same slots."""
    base = ("--preset", "mixtral-8x7b", "--world-size", "64", "--fsdp", "8", "--ep", "8", "--batch-size", "64")
    parts = {}
    for replicas in ("0", "8"):
        rc, out, err = dry(capsys, *base, "--layout.expert_replicas", replicas)
        assert rc == 0 and "the estimate agrees" in out and "init:" not in out, err + out  # each rank: its share
        parts[replicas] = out.split("the estimate agrees): ")[1].split("\n")[0]
    experts = {r: next(p for p in text.split(", ") if p.startswith("experts")) for r, text in parts.items()}
    assert experts == {"0": "experts 704.64M", "8": "experts 1.41B"}, experts  # 32 x 176.2M / fsdp 8, then x 2
    # importing an HF folder into a placement reads it by slices as well: each slot its logical expert's rows (a
    # dry run reads only the folder's config.json)
    import dataclasses
    import json

    from moekit.models.hf.export import hf_config
    from moekit.models.transformer import Transformer, meta_device

    with meta_device():
        whole = Transformer(preset("mixtral-8x7b"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(whole, "mixtral", "bfloat16")))
    rc, out, err = dry(capsys, *base, "--layout.expert_replicas", "8", "--init-from-hf", str(tmp_path))
    assert rc == 0 and "init:" not in out and parts["8"] in out, err + out
    # upcycling (Mistral-7B-like -> 8x7B) fills each rank's shards too, from the slices of the dense model they are
    # made of: host memory at most one dense MLP (3 x 14336 x 4096) or the embedding in fp32 (a dry run reads no
    # weights)
    dense_dir = tmp_path / "dense"
    dense_dir.mkdir()
    with meta_device():
        dense = Transformer(dataclasses.replace(preset("mixtral-8x7b"), num_experts=0, ffn_hidden_size=14336))
    (dense_dir / "config.json").write_text(json.dumps(hf_config(dense, "llama", "bfloat16")))
    rc, out, err = dry(capsys, *base, "--init-from-dense", str(dense_dir))
    mlp = sum(p.numel() for p in dense.layers[0].ffn.parameters())
    assert mlp > dense.embed.weight.numel()
    assert rc == 0 and parts["0"] in out and ("init: every rank upcycles its shards from the slices of the dense model "
                                             f"they are made of (no rank reads it whole; host memory at most "
                                             f"{4 * mlp / 2**30:.2f} GiB at once") in out, err + out


def test_dry_run_512_ranks_deepseek_v3(capsys):
    """pp 16 x fsdp 32, ep 8: the recipe measures it where it supports pp / FSDP, else the estimate stands alone."""
    rc, out, err = dry(capsys, "--preset", "deepseek-v3-like", "--world-size", "512", "--pp", "16", "--fsdp", "32",
                       "--ep", "8", "--batch-size", "1024", "--train.seq_len", "4096",
                       "--train.activation_checkpointing", "full")
    assert rc == 0, err
    assert ("the estimate agrees" in out) != ("does not run this layout yet" in out), out
    assert "pipeline rank 15: layers" in out and ": fits" in out
    print(out)


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2"])
def test_dry_run_of_the_mla_releases_agrees_with_the_recipe(capsys, name):
    """The real MLA models (the presets their checkpoints import as) at 512 ranks: the recipe's shards, part by
    part, are the estimate's. The latent q / kv norms count as norms on both sides (they were filed under
    attention by the estimate, which the recipe flagged as a mismatch)."""
    rc, out, err = dry(capsys, "--preset", name, "--world-size", "512", "--pp", "8", "--fsdp", "64", "--ep", "64",
                       "--batch-size", "512", "--train.micro_batch_size", "1", "--train.seq_len", "4096")
    assert rc == (dryrun.DOES_NOT_FIT if "does NOT fit" in out else 0) and err == "", err  # ~150 GiB at pp 8
    assert "the estimate agrees" in out and "MISMATCH" not in out, out
    assert "norms 2048" in out  # rank 0's 8 layers x (1536 + 512 + 2 x 7168) norm elements / fsdp 64


def test_dry_run_512_ranks_sequence_parallel(capsys):
    """Long sequences at tp 8: SP reaches the recipe (the meta model's shards still agree) and the estimate,
    which keeps the residual stream and the MoE input on 1/8 of the sequence (docs/parallelism.md)."""
    rc, out, err = dry(capsys, "--preset", "mixtral-8x7b", "--world-size", "512", "--fsdp", "64", "--tp", "8", "--ep",
                       "8", "--batch-size", "64", "--train.seq_len", "32768", "--train.activation_checkpointing", "ffn",
                       "--layout.sequence_parallel", "true")
    assert rc == 0, err
    assert "activation checkpointing ffn, sequence parallel on" in out and "the estimate agrees" in out
    assert "residual 2.00 GiB" in out and "peak 28.11 GiB" in out  # off: residual 16.00 GiB, peak 49.12 GiB
    print(out)


def test_dry_run_plans_document_masking(capsys):
    """--data.document_mask true reaches the estimate (Workload.document_mask; a dry run reads no data, so there is
    no end-of-document check): gpt-oss-20b at S 4096 on 64 ranks, its 12 full layers' sink calls masked (k' and v'
    expanded to the 64 query heads and a [1, 1, 4096, 4112] mask instead of causal SDPA): attention 4.43 -> 5.54 GiB,
    and the report says so."""
    base = ["--preset", "gpt-oss-20b", "--world-size", "64", "--ep", "8", "--fsdp", "64", "--batch-size", "64",
            "--train.seq_len", "4096"]
    out = {}
    for flag in ("false", "true"):
        rc, out[flag], err = dry(capsys, *base, "--data.document_mask", flag)
        assert rc == 0 and "the estimate agrees" in out[flag], err + out[flag]
    assert "attention 4.43 GiB" in out["false"] and "attention within documents" not in out["false"], out["false"]
    assert "attention 5.54 GiB" in out["true"], out["true"]
    assert "checkpointing none, attention within documents (every call masked)\n" in out["true"], out["true"]


@pytest.mark.parametrize("args,match", [
    (["--world-size", "6", "--ep", "3"], "num_experts=8 is not divisible"),
    (["--world-size", "512", "--dp", "100"], "world size is 512"),
    (["--world-size", "6", "--tp", "3"], "--tp 3 must divide num_heads=4, num_kv_heads=2"),
    (["--world-size", "8", "--pp", "8"], "num_layers=4 is fewer than the 8 pipeline stages"),
    (["--world-size", "64"], "--batch-size 16 must split into 64 data-parallel shares"),
    (["--world-size", "0"], "--world-size 0"),
    (["--world-size", "2", "--tp", "2", "--layout.sequence_parallel", "true", "--train.seq_len", "63"],
     "seq_len=63 is not divisible by --tp 2"),
])
def test_dry_run_refuses_bad_layouts_in_one_line(capsys, args, match):
    rc, out, err = dry(capsys, *args)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("train.py: error:") and match in err, err


def test_world_size_needs_dry_run():
    with pytest.raises(UserError, match="only with --dry-run"):
        parse_args(["--world-size", "4"])


@pytest.mark.parametrize("router,options,z", [
    ("topk", {"normalize": True}, 0.0),
    ("topk", {"score": "sigmoid", "expert_bias": True, "bias_update_rate": 1e-3, "scaling": 2.5}, 1e-3),
    ("switch", {"jitter": 0.0}, 0.0),
])
def test_router_term_counts_what_the_fused_router_keeps(monkeypatch, router, options, z):
    """On CUDA the router runs as moe.kernels.topk_route (FUSED_ROUTER): the planner's router term must be
    the bytes autograd keeps for it. Measured here with the kernel in the interpreter (FUSED_ROUTER
    "always"), the input and the parameters excluded, as the block's inputs count the former."""
    from moekit.moe import router as router_mod
    from moekit.moe.kernels._common import interpret_mode
    from moekit.moe.router import build_router
    from moekit.train.planning import activations as A

    if not interpret_mode():
        pytest.skip("needs the Triton interpreter (CPU)")
    monkeypatch.setattr(router_mod, "FUSED_ROUTER", "always")
    cfg = dataclasses.replace(preset("mixtral-tiny"), router=router, router_options=options, z_loss_coeff=z,
                              top_k=1 if router == "switch" else 4, aux_loss_coeff=0.01)
    r = build_router(cfg.router, cfg.hidden_size, cfg.num_experts, **cfg.router_kwargs()).train()
    T = 96
    x = torch.randn(T, cfg.hidden_size, requires_grad=True)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        r(x)
    skip = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in r.parameters()}
    measured = sum(n for ptr, n in seen.items() if ptr not in skip)
    s = dataclasses.replace(A.shapes(cfg, Layout(), Workload(1, T, "float32", "none", "cuda")), Tm=T, cpu=False)
    assert A.fused_router_applies(cfg, cpu=False)
    assert A._router(cfg, s) == measured


def test_planner_resolves_auto_experts_as_the_layer_does():
    """The selective-checkpoint estimate depends on the expert backend; "auto" must resolve as
    moe.experts.auto_order does (the loop on CPU; on a GPU Triton, torch for large experts)."""
    import torch

    from moekit.moe.experts import auto_order
    from moekit.train.planning import activations as A

    for name in ("mixtral-tiny", "mixtral-1b", "mixtral-8x7b", "qwen3-moe-30b-a3b", "deepseek-v3-like", "glm-4.5-air"):
        cfg = preset(name)
        w_out = torch.empty(1, cfg.moe_ffn_hidden_size, cfg.hidden_size, device="meta")
        assert A._auto_backend(cfg, cpu=False) == auto_order(torch.device("cuda"), w_out)[0], name
        assert A._auto_backend(cfg, cpu=True) == auto_order(torch.device("cpu"), w_out)[0] == "loop"
    assert A._auto_backend(preset("mixtral-8x7b"), cpu=False) == "torch"
    assert A._auto_backend(preset("mixtral-1b"), cpu=False) == "triton"


def test_new_objects_gc_collects_what_the_block_made_and_restores_the_heap():
    """planning.linear_memory.new_objects_gc: a cycle made inside is collected by a collection inside (which walks the
    block's objects only); the heap it froze is unfrozen after, and a process's own frozen objects stay frozen."""
    import weakref

    class Node:
        pass

    assert gc.get_freeze_count() == 0
    gc.disable()  # no automatic collection between the del and the explicit one
    try:
        with new_objects_gc():
            assert gc.get_freeze_count() > 0  # the older heap
            a, b = Node(), Node()
            a.other, b.other = b, a  # cyclic garbage once the names go
            ref = weakref.ref(a)
            del a, b
            assert ref() is not None
            gc.collect()
            assert ref() is None
    finally:
        gc.enable()
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the process's own
    try:
        frozen = gc.get_freeze_count()  # less as frozen objects die; more only if something froze again
        with new_objects_gc():
            assert gc.get_freeze_count() <= frozen
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
