"""The processes of one merge launched with ``torchrun`` or ``accelerate launch``.

``torchrun --nproc-per-node W -m mergekit_ext run CONFIG OUT`` starts W processes that
each run ``mergekit-ext run``; they read the ``torch.distributed`` environment
(``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and join one
process group: gloo on CPU, NCCL for CUDA tensors (with gloo beside it for the small
control messages) where ``--device cuda`` puts rank r on ``cuda:LOCAL_RANK``.

With W ≤ K processes for K tasks, rank r owns the tasks ``{k : k mod W = r}``
(:meth:`DistributedContext.owned`); with W > K, each task gets a contiguous group of ranks
(:func:`task_ranks`), each of which runs a contiguous share of the task's calibration
batches. The sequential executor runs those forward passes and statistics there; its
rank strategy (:class:`mergekit_ext.executor.strategy.RankStrategy`) combines the statistics
with the collectives below. Only rank 0 writes anything.

Every collective is bounded by the process group's timeout (``--distributed-timeout``,
default :data:`DEFAULT_TIMEOUT_S`); a rank that fails exits at once, which closes its
connections, so the others fail in their next collective instead of waiting. The
collectives here turn those failures into a :class:`DistributedError` naming the rank.

Without ``WORLD_SIZE`` (or with ``WORLD_SIZE=1``) nothing is initialised and every helper
is the identity: a single process runs exactly the code it always ran.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch

from mergekit_ext.errors import MergekitExtError

LOG = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800.0
# A collective bound below this fails before any real merge could pass one (and torch then
# prints its C++ stack); nan/inf are no bound at all.
MIN_TIMEOUT_S = 1.0
# Joining the process group: without --distributed-timeout a rank waits this long for the
# others (a rank pointed at a wrong MASTER_PORT would otherwise retry for DEFAULT_TIMEOUT_S).
DEFAULT_JOIN_TIMEOUT_S = 300.0


class DistributedError(MergekitExtError, RuntimeError):
    """A collective failed or another rank of the merge reported a failure."""


@dataclass
class DistributedContext:
    """Who this process is in the merge; ``world_size == 1`` is the plain single process."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    backend: Optional[str] = None  # "gloo" | "nccl" (the tensors' backend)
    timeout_s: float = DEFAULT_TIMEOUT_S
    _object_group: Any = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes the output, the card and the diagnostics; the others write nothing."""
        return self.rank == 0

    @property
    def label(self) -> str:
        return f"rank {self.rank}/{self.world_size}"

    def ranks_of(self, task_index: int, num_tasks: int) -> list[int]:
        """The ranks that run task ``task_index``'s forward passes (:func:`task_ranks`)."""
        return task_ranks(self.world_size, num_tasks)[task_index]

    def owner(self, task_index: int, num_tasks: int) -> int:
        """The rank that holds the task's statistics: the one with its last batches."""
        return self.ranks_of(task_index, num_tasks)[-1]

    def owned(self, num_tasks: int) -> list[int]:
        """The tasks whose passes this rank runs: ``{k : k mod W = rank}`` for W ≤ K; one
        task (a contiguous share of its batches) for W > K."""
        return [k for k in range(num_tasks) if self.rank in self.ranks_of(k, num_tasks)]

    def holds(self, num_tasks: int) -> list[int]:
        """The tasks whose statistics end on this rank (its owned tasks for W ≤ K)."""
        return [k for k in range(num_tasks) if self.owner(k, num_tasks) == self.rank]

    def share(self, task_index: int, num_tasks: int, num_batches: int) -> tuple[int, int]:
        """This rank's contiguous share ``[start, stop)`` of the task's batches."""
        ranks = self.ranks_of(task_index, num_tasks)
        return batch_share(ranks.index(self.rank), len(ranks), num_batches)

    def check_tasks(self, num_tasks: int) -> None:
        check_tasks(self.world_size, num_tasks)

    # ----------------------------------------------------------------------------------
    # Collectives (no-ops for a single process)

    def _failed(self, what: str, error: BaseException) -> DistributedError:
        return DistributedError(
            f"{self.label}: {what} failed ({' '.join(str(error).split())[:300]}); another rank "
            "of the merge has probably failed or stopped: see its error"
        )

    def broadcast_tensor(
        self,
        tensor: Optional[torch.Tensor],
        shape: Sequence[int],
        dtype: torch.dtype,
        device,
        src: int = 0,
    ) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` on every rank (the others pass None and get a new one)."""
        if not self.enabled:
            assert tensor is not None
            return tensor
        import torch.distributed as dist

        if self.rank == src:
            assert tensor is not None
            buffer = tensor.to(device=device, dtype=dtype).contiguous()
        else:
            buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
        try:
            dist.broadcast(buffer, src=src)
        except RuntimeError as e:  # DistBackendError, timeouts, closed connections
            raise self._failed("a broadcast of merged weights", e) from e
        return buffer

    def send_tensors(self, tensors: dict[str, torch.Tensor], dst: int) -> None:
        """Send ``tensors`` (keys in sorted order) to rank ``dst``."""
        import torch.distributed as dist

        try:
            for key in sorted(tensors):
                dist.send(tensors[key].contiguous(), dst=dst)
        except RuntimeError as e:
            raise self._failed(f"sending statistics to rank {dst}", e) from e

    def recv_tensors(self, tensors: dict[str, torch.Tensor], src: int) -> None:
        """Receive into ``tensors`` (same keys, shapes and dtypes as the sender's) from ``src``."""
        import torch.distributed as dist

        try:
            for key in sorted(tensors):
                dist.recv(tensors[key], src=src)
        except RuntimeError as e:
            raise self._failed(f"receiving statistics from rank {src}", e) from e

    def send_object(self, obj: Any, dst: int) -> None:
        """Send a picklable object (tensors on any device) to rank ``dst``."""
        import io

        import torch.distributed as dist

        buffer = io.BytesIO()
        torch.save(obj, buffer)
        payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        try:
            dist.send(
                torch.tensor([payload.numel()], dtype=torch.int64),
                dst=dst,
                group=self._object_group,
            )
            dist.send(payload, dst=dst, group=self._object_group)
        except RuntimeError as e:
            raise self._failed(f"sending partial statistics to rank {dst}", e) from e

    def recv_object(self, src: int, device: Any = "cpu") -> Any:
        """Receive what rank ``src`` sent with :meth:`send_object`; tensors onto ``device``."""
        import io

        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64)
        try:
            dist.recv(size, src=src, group=self._object_group)
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(payload, src=src, group=self._object_group)
        except RuntimeError as e:
            raise self._failed(f"receiving partial statistics from rank {src}", e) from e
        return torch.load(
            io.BytesIO(payload.numpy().tobytes()), map_location=device, weights_only=False
        )

    def gather_objects(self, obj: Any) -> Optional[list[Any]]:
        """Every rank's ``obj`` on rank 0, in rank order (None elsewhere); CPU tensors only."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        gathered: Optional[list[Any]] = [None] * self.world_size if self.is_writer else None
        try:
            dist.gather_object(obj, gathered, dst=0, group=self._object_group)
        except RuntimeError as e:
            raise self._failed("a gather of per-task statistics", e) from e
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (picklable, CPU tensors only) on every rank."""
        if not self.enabled:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        try:
            dist.broadcast_object_list(box, src=src, group=self._object_group)
        except RuntimeError as e:
            raise self._failed("a broadcast of diagnostics", e) from e
        return box[0]

    def agree(self, error: Optional[BaseException], phase: str) -> None:
        """Every rank says whether ``phase`` succeeded; all fail when one did.

        Called by every rank at the same point (after the checks before a merge, after
        rank 0 renamed the output). A rank with ``error`` returns and re-raises its own;
        the others raise a :class:`DistributedError` naming the first failed rank.
        """
        if not self.enabled:
            return
        import torch.distributed as dist

        mine = None if error is None else (" ".join(str(error).split()) or type(error).__name__)
        everyone: list[Optional[str]] = [None] * self.world_size
        try:
            dist.all_gather_object(everyone, mine, group=self._object_group)
        except RuntimeError as e:
            if error is not None:
                return  # our own error is the one to report
            raise self._failed(f"the agreement after {phase}", e) from e
        if error is not None:
            return
        for rank, message in enumerate(everyone):
            if message is not None:
                raise DistributedError(f"{self.label}: rank {rank} failed {phase}: {message}")


def task_ranks(world_size: int, num_tasks: int) -> list[list[int]]:
    """Per task, the ranks that run its passes, in the order of their batch shares.

    W ≤ K: task k on rank ``k mod W`` alone. W > K: the ranks split into K contiguous groups
    (the first ``W mod K`` tasks get one rank more), so a node's ranks tend to share a task.
    """
    if world_size <= num_tasks:
        return [[k % world_size] for k in range(num_tasks)]
    per, extra = divmod(world_size, num_tasks)
    groups, start = [], 0
    for k in range(num_tasks):
        size = per + (1 if k < extra else 0)
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def batch_share(position: int, ranks: int, num_batches: int) -> tuple[int, int]:
    """Share ``position`` of ``ranks`` contiguous shares of ``num_batches`` batches, as
    ``[start, stop)``; the last share is never empty while there is a batch."""
    return (position * num_batches) // ranks, ((position + 1) * num_batches) // ranks


def check_tasks(world_size: int, num_tasks: int) -> None:
    """The rule for how many processes a merge of ``num_tasks`` tasks may have, for the run
    and for its plan (``--dry-run --world-size``): any number; beyond K processes several
    ranks share one task's batches (each needs at least one batch:
    :func:`check_shares`)."""
    if num_tasks < 1:
        raise DistributedError("a merge over several processes needs at least one task")


def check_shares(world_size: int, batches: Sequence[tuple[str, int]]) -> None:
    """Each rank that shares a task needs one of its batches at least.

    Args:
        world_size: W.
        batches: per task, its name and its number of calibration batches.
    """
    for (name, count), ranks in zip(batches, task_ranks(world_size, len(batches))):
        if len(ranks) > count:
            raise DistributedError(
                f"{world_size} processes for {len(batches)} tasks give task {name} "
                f"{len(ranks)} ranks but it has {count} calibration batches: each rank needs a "
                f"batch at least; launch at most {len(batches) * min(c for _, c in batches)} "
                "processes, or use a smaller calibration batch_size"
            )


def check_timeout(seconds: float) -> float:
    """``--distributed-timeout``: a finite number of seconds, at least :data:`MIN_TIMEOUT_S`."""
    if not math.isfinite(seconds) or seconds < MIN_TIMEOUT_S:
        raise DistributedError(
            f"--distributed-timeout must be a finite number of seconds >= {MIN_TIMEOUT_S:g}; "
            f"got {seconds!r} (default {DEFAULT_TIMEOUT_S:g}: how long a rank waits for the "
            "others in each collective)"
        )
    return float(seconds)


_CURRENT = DistributedContext()


def current() -> DistributedContext:
    """The context :func:`init_from_env` set up (a single process when it did not run)."""
    return _CURRENT


def world_size_from_env() -> int:
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"WORLD_SIZE={value!r} is not a number") from None


def _wants_cuda(device: Optional[str]) -> bool:
    name = (device or "cpu").strip()
    return name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())


def init_from_env(device: Optional[str], timeout_s: Optional[float] = None) -> DistributedContext:
    """Join the process group described by the environment (a no-op for one process).

    Args:
        device: ``--device``; ``cuda`` selects NCCL for tensors and ``cuda:LOCAL_RANK``.
        timeout_s: bound of every collective and of joining, seconds (at least
            :data:`MIN_TIMEOUT_S`); without it, collectives wait :data:`DEFAULT_TIMEOUT_S`
            and joining :data:`DEFAULT_JOIN_TIMEOUT_S`. A rank that cannot join within that
            bound ends its process with status 1 and a message (torch's wait cannot be
            interrupted): this is for the ``mergekit-ext run`` process, before it writes.

    Returns:
        The context, also returned by :func:`current` from now on.
    """
    global _CURRENT
    timeout = check_timeout(float(timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S))
    join_s = timeout if timeout_s is not None else min(timeout, DEFAULT_JOIN_TIMEOUT_S)
    world = world_size_from_env()
    if world <= 1:
        _CURRENT = DistributedContext(timeout_s=timeout)
        return _CURRENT
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise DistributedError(
            f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with torchrun "
            "--nproc-per-node W -m mergekit_ext run ... (or accelerate launch)"
        )
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if (
        os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost")
        and "GLOO_SOCKET_IFNAME" not in os.environ
        and os.path.exists("/sys/class/net/lo")
    ):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # single machine: gloo on the loopback device
    cuda = _wants_cuda(device)
    if cuda:
        if not torch.cuda.is_available():
            raise DistributedError(f"--device {device} but CUDA is not available on {rank=}")
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(
                f"rank {rank} has LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} "
                "CUDA devices are visible: launch at most one process per GPU"
            )
        torch.cuda.set_device(local_rank)
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if rank == 0:
        _check_port_free(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], world)
    label = f"rank {rank}/{world}"
    try:
        # torch bounds the rendezvous by the timeout only while it can connect: a port held by
        # something else accepts and never answers, and the C++ handshake waits for ever.
        with _join_watchdog(label, address, join_s):
            dist.init_process_group(
                backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
                init_method="env://",
                world_size=world,
                rank=rank,
                timeout=timedelta(seconds=timeout),
            )
            # Pickled control messages stay on CPU even when the tensors go through NCCL.
            group = (
                dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) if cuda else None
            )
    except (RuntimeError, ValueError) as e:
        raise DistributedError(
            f"{label}: joining the process group at {address} failed within {join_s:g} s: "
            f"{_first_line(e)}; check MASTER_ADDR/MASTER_PORT and that every rank was started"
        ) from None
    _CURRENT = DistributedContext(
        world_size=world,
        rank=rank,
        local_rank=local_rank,
        backend="nccl" if cuda else "gloo",
        timeout_s=timeout,
        _object_group=group,
    )
    LOG.info("%s joined the merge (backend %s)", _CURRENT.label, _CURRENT.backend)
    return _CURRENT


def _first_line(error: BaseException) -> str:
    """An error of torch's C++ side without its stack (it can run to dozens of frames)."""
    text = str(error).strip().splitlines()
    return " ".join(text[0].split()) if text else type(error).__name__


def _check_port_free(addr: str, port: str, world: int) -> None:
    """Rank 0 serves the rendezvous on MASTER_PORT (unless a torchrun agent already does):
    a port another program holds is refused here with the remedy, not a C++ stack."""
    from torch.distributed.rendezvous import _torchelastic_use_agent_store

    if _torchelastic_use_agent_store():
        return  # torchrun's agent bound it; the ranks connect to the agent
    try:
        number = int(port)
    except ValueError:
        raise DistributedError(f"MASTER_PORT={port!r} is not a port number") from None
    # Rank 0 runs on MASTER_ADDR's machine; SO_REUSEADDR as the store's own socket, so that
    # only a listening socket (not a closed connection in TIME_WAIT) counts as busy.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", number))
        except OSError as e:
            raise DistributedError(
                f"rank 0/{world}: MASTER_PORT {number} on {addr} is in use ({e.strerror}); "
                "another program (or another merge) holds it: pick a free port "
                "(torchrun --master-port P, or MASTER_PORT=P)"
            ) from None


@contextlib.contextmanager
def _join_watchdog(label: str, address: str, seconds: float) -> Iterator[None]:
    """Bound a blocking rendezvous: a line after 10 s, a clear exit after ``seconds``.

    The wait is inside torch's C++ code, which no Python exception interrupts; nothing has
    been written yet, so the process ends with status 1 and the message.
    """

    def waiting() -> None:
        print(
            f"{label}: waiting for the other ranks at {address} (at most {seconds:g} s; "
            "--distributed-timeout)",
            file=sys.stderr,
            flush=True,
        )

    def give_up() -> None:
        print(
            f"error: {label}: no process group at {address} within {seconds:g} s: the other "
            "ranks did not start, or another program holds that port; check MASTER_ADDR/"
            "MASTER_PORT (torchrun --master-port) and start every rank",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timers = [
        threading.Timer(min(10.0, seconds / 2), waiting),
        threading.Timer(seconds + 2, give_up),
    ]
    for timer in timers:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        for timer in timers:
            timer.cancel()


def shutdown() -> None:
    """Leave the process group (if one was joined); the context is a single process again."""
    global _CURRENT
    if _CURRENT.enabled:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError as e:  # pragma: no cover - a peer already gone
                LOG.debug("destroy_process_group: %s", e)
    _CURRENT = DistributedContext(timeout_s=_CURRENT.timeout_s)
