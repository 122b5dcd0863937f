"""What the training loop needs from the layout: one object, the same calls in one process and many.

``Dist.setup`` reads the launch (torchrun's env via comm.topology), starts the process group, and
validates the layout before any work. In one process every method is a cheap identity, so the loop
reads the same in both cases and the single-process run stays bitwise what it was.
"""
from __future__ import annotations

import atexit
import math
import os
import re
import sys
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from moekit.comm.grad_sync import clip_gradients, sync_gradients
from moekit.comm.topology import Layout, LayoutError, Topology
from moekit.train import UserError


# How gloo reports a collective that timed out or lost its peer (it raises plain RuntimeErrors); NCCL and
# the stores raise torch.distributed.DistError subclasses.
_COMM_MESSAGES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "pair closure",
                  "Broken pipe", "gloo/transport")


# Whether this process started the process group (Dist.setup): see owns_process_group.
_started_group = False


def owns_process_group() -> bool:
    """Whether this process started a process group (Dist.setup), so that it must end without finalizing the
    interpreter (moekit.train.loop.main does, after its orderly teardown).

    gloo runs each group's collectives on worker threads (pt_gloo_runloop) that only the group's C++
    destructor joins, and destroy_process_group does not run it: the Topology, the DeviceMeshes and torch's
    DTensor caches still hold the groups, until interpreter finalization or forever. A worker that lets go of
    its last collective after the rank has moved on (the final barrier, whose work keeps the collective
    before it, all_gather_object's Python-owned tensors, alive) must take the GIL to free them; during
    finalization CPython ends such a thread with pthread_exit, whose unwinding through the noexcept
    destructor calls std::terminate: "terminate called without an active exception", exit -6, now and then
    (seen in about 1 of 20 loaded runs of 4 ranks; core dumps show ~AsyncBarrierWork -> ~AsyncAllgatherWork
    -> decref_pyobject -> take_gil -> PyThread_exit_thread while the main thread is in Py_FinalizeEx)."""
    return _started_group


def end_process(code: int, run_exit_handlers: bool = True) -> NoReturn:
    """End this process with ``code`` without finalizing the interpreter: what a rank that ran gloo
    collectives must do, since finalization races the groups' worker threads (owns_process_group).
    ``run_exit_handlers``: first run what a normal exit runs before finalizing (atexit handlers: logging's
    flush, weakref finalizers, ...); False where one of them could block (a save thread hung in the file
    system). stdout and stderr are flushed either way."""
    if run_exit_handlers:
        atexit._run_exitfuncs()  # no public API runs them; os._exit skips them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def first_line(exc: BaseException) -> str:
    """The gist of an exception's message: its last line's first sentence, without gloo's source location
    ("[.../unbound_buffer.cc:78] ") and advice ("Connection reset by peer. This is typically caused by ...")."""
    lines = str(exc).strip().splitlines()
    line = lines[-1] if lines else type(exc).__name__
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", line).split(". ", 1)[0]


def comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective or store failure (a timeout or a lost peer), not a bug or bad data."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_MESSAGES)


class Dist:
    def __init__(self, topology: Topology, device: torch.device, timeout_s: float = 600.0):
        self.topology, self.device, self.timeout_s = topology, device, timeout_s  # how long a collective may wait
        self.world = topology.layout.world_size
        self.rank = topology.rank
        self.is_main = self.rank == 0
        self.data_parallel = topology.layout.data_parallel
        self.data_rank = topology.data_rank()
        self.fsdp = False  # set by parallelize(): fully_shard reduces the gradients
        self.grad_roles: dict[str, str] = {}  # set by parallelize(): parameter name -> gradient role
        self.context = None  # set by parallelize() when cp > 1: comm.context_parallel's strategy
        # this rank's stop request (a signal number, 0 = none): set by the trainer, agreed on by agree_stop()
        self.stop_signal = lambda: 0
        self._agreed_stop: int | None = None  # the stop request that rode on this step's non-finite check
        self.spike_any = False  # a loss spike on any rank at this step's non-finite check (moekit.train.spikes)

    @classmethod
    def setup(cls, layout: Layout, num_experts: int, device: torch.device, ranks_per_node: int | None,
              timeout_s: float) -> "Dist":
        """``layout``: moekit.train.plan.resolve_layout's degrees; Topology.from_env checks them against this
        launch (the same world size the resolution used, unless the environment changed in between)."""
        try:
            topology = Topology.from_env(layout, num_experts or None, ranks_per_node)
        except LayoutError as exc:
            raise UserError(str(exc)) from None
        world = topology.layout.world_size
        if world > 1 and not dist.is_initialized():
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK") if v not in os.environ]
            if missing:
                raise UserError(f"WORLD_SIZE={world} but {', '.join(missing)} unset: launch several ranks with "
                                f"torchrun --nproc-per-node {world} -m moekit.train ...")
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            # a rank that never arrives (crash, mismatched launch) surfaces as an error after timeout_s
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
            global _started_group
            _started_group = True  # from here on this process ends through os._exit (owns_process_group)
        if world > 1:
            # EP / DP groups and the device meshes time out like the default group
            topology.build(timeout=timedelta(seconds=timeout_s), device_type=device.type)
        return cls(topology, device, timeout_s)

    @property
    def active(self) -> bool:
        return self.world > 1

    def parallelize(self, model, hierarchical: bool | None = None, **recipe) -> None:
        """moekit.models.parallelize's recipe; in one process only its single-device steps (AC, compile)."""
        from moekit.models.parallelize import parallelize

        try:
            done = parallelize(model, self.topology if self.active else None, hierarchical=hierarchical, **recipe)
        except LayoutError as exc:
            raise UserError(str(exc)) from None
        self.fsdp, self.grad_roles, self.context = done.fsdp, done.grad_roles, done.context

    def share(self, batch, per_rank: int):
        """This rank's contiguous share of the global batch (DESIGN.md)."""
        return batch[self.data_rank * per_rank : (self.data_rank + 1) * per_rank]

    def positions(self, *batches):
        """This rank's positions of each [b, S] tensor: all of them, or its context-parallel share."""
        if self.context is None:
            return batches
        return tuple(self.context.shard(t) for t in batches)

    def sync_grads(self, model) -> None:
        if self.active:
            sync_gradients(model, self.topology, self.grad_roles, fsdp=self.fsdp)

    @property
    def loss_ranks(self) -> int:
        """The ranks whose losses ``mean`` averages (data and context parallel: the "dp" group), 1 in one process."""
        return dist.get_world_size(self.topology.group("dp")) if self.active else 1

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean over the data-parallel ranks (each rank's value is a mean over its equal share; a
        context-parallel rank's share is its part of each sequence)."""
        if not self.active:
            return value
        out = value.detach().clone()
        group = self.topology.group("dp")
        dist.all_reduce(out, group=group)
        return out / dist.get_world_size(group)

    def clip_grad_norm(self, params, max_norm: float, parts: int = 0):
        """Global gradient norm over every shard (TP, EP, FSDP), clipped like torch's. ``parts`` > 0: (the norm, each
        part's norm before clipping [parts]), a parameter's part its ``grad_part`` (moekit.train.grad_parts)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not self.active:
            by_part = None
            total = None
            if parts and grads:  # before clipping, from one pass of per-tensor norms
                norms = torch.stack(torch._foreach_norm(grads))
                if len({(g.device, g.dtype) for g in grads}) == 1:  # torch's total is these norms' norm, bit for bit
                    total = torch.linalg.vector_norm(norms)
                tags = [getattr(p, "grad_part", None) for p in params if p.grad is not None]
                keep = [i for i, tag in enumerate(tags) if tag is not None]
                index = torch.tensor([tags[i] for i in keep], dtype=torch.long, device=norms.device)
                by_part = torch.zeros(parts, device=norms.device).index_add(
                    0, index, norms[keep].float().square()).sqrt()
            elif parts:
                by_part = torch.zeros(parts, device=self.device)
            if total is None:
                total = torch.nn.utils.get_total_norm(grads)
            if max_norm > 0:  # a non-finite norm leaves the gradients as they are (comm.grad_sync.clip_gradients)
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.where(total.isfinite(), total, 0.0))
            return (total, by_part) if parts else total
        pp = self.topology.group("pp") if self.topology.layout.pp > 1 else None
        return clip_gradients(params, max_norm, self.device, pp, parts)

    def reduce_load(self, load: dict) -> dict:
        """Sum every layer's expert counts over the stage's ranks (data ranks x TP token slices): the record
        covers the global batch."""
        if not self.active or not load:
            return load
        names = list(load)
        flat = []
        for n in names:
            s = load[n]
            flat += s.tokens_per_expert + s.assigned_per_expert + [s.dropped_slots]
        t = torch.tensor(flat, dtype=torch.float64, device=self.device)
        aux = torch.tensor([load[n].aux_loss for n in names], dtype=torch.float64, device=self.device)
        group = self.topology.group("stage")
        dist.all_reduce(t, group=group)
        dist.all_reduce(aux, group=group)
        values = t.cpu().tolist()  # D2H sync: once per step, for the records
        i = 0
        for j, n in enumerate(names):
            s, E = load[n], len(load[n].tokens_per_expert)
            s.tokens_per_expert = [int(v) for v in values[i : i + E]]
            s.assigned_per_expert = [int(v) for v in values[i + E : i + 2 * E]]
            s.dropped_slots = int(values[i + 2 * E])
            s.aux_loss = float(aux[j]) / dist.get_world_size(group)  # mean over the token slices
            i += 2 * E + 1
        return load

    def any_nonfinite(self, *values: float, spike: bool = False) -> bool:
        """Every rank agrees: if any rank sees a non-finite value, all of them stop.

        The same all-reduce carries this rank's stop request (``stop_signal``), so agreeing on a
        preemption costs no collective of its own: ``agree_stop`` reads the result; and this rank's loss-spike
        verdict (moekit.train.spikes), agreed in ``spike_any``."""
        bad = any(not math.isfinite(v) for v in values)
        if not self.active:
            self._agreed_stop = self.stop_signal()
            self.spike_any = spike
            return bad
        flags = torch.tensor([float(bad), float(self.stop_signal()), float(spike)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad_any, stop, spiked = flags.tolist()  # D2H sync: the decision must be on the host
        self._agreed_stop = int(stop)
        self.spike_any = spiked > 0
        return bad_any > 0

    def agree_stop(self) -> int:
        """The signal every rank stops for after this step (the highest number any rank got), 0 to go on.

        Read from this step's non-finite check when it ran (``Guard.check``); else one all-reduce."""
        agreed, self._agreed_stop = self._agreed_stop, None
        if agreed is not None:
            return agreed
        if not self.active:
            return self.stop_signal()
        flag = torch.tensor([float(self.stop_signal())], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def from_main(self, fn):
        """``fn()`` on rank 0 (its result there, None elsewhere); a UserError it raises is raised on every
        rank, so all of them stop together instead of the others waiting for rank 0 (collective)."""
        answer: list = [None]  # the exception itself: its class (UserError, RunFailed) sets the exit status
        result = None
        if self.is_main:
            try:
                result = fn()
            except UserError as exc:
                answer[0] = exc
        if self.active:
            dist.broadcast_object_list(answer, src=0)
        if answer[0] is not None:
            raise answer[0]
        return result

    def any_flags(self, flags: torch.Tensor) -> torch.Tensor:
        """Element-wise OR of a bool tensor over every rank (e.g. which layer went non-finite where)."""
        if not self.active:
            return flags
        out = flags.to(torch.int32)  # gloo reduces no bools
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out.bool()

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def failure(self, exc: BaseException, step: int | None) -> str | None:
        """One line for a collective that failed (timed out, or a peer went away); None for other errors. ``step``
        None: while the run set up (the model built, the checkpoint it resumes from loaded)."""
        if not self.active or not comm_failure(exc):
            return None
        when = "while the run set up (building the model, loading its checkpoint)" if step is None else f"at step {step}"
        return (f"rank {self.rank}: a collective failed {when} ({first_line(exc)}): another rank stopped, "
                f"crashed or stalled past --layout.timeout_s={self.timeout_s:g} (raise it only if ranks legitimately "
                f"wait longer: slow saves, long evaluations)")

    def close(self, together: bool = False) -> None:
        """Tear the process groups down. ``together``: every rank got here the normal way, so first wait for
        all of them (a barrier, bounded by --layout.timeout_s): no rank leaves while another may still be in
        a collective with it. destroy_process_group only unregisters the groups; their gloo worker threads
        live on until the process ends, which is why a rank ends without finalizing (owns_process_group)."""
        if self.active and dist.is_initialized():
            if together:
                try:
                    dist.barrier()
                except RuntimeError:  # a rank that failed after all: tear down regardless, it has said why
                    pass
            dist.destroy_process_group()
