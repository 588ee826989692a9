"""The processes of one merge launched with ``torchrun`` or ``accelerate launch``.

``torchrun --nproc-per-node W -m mergekit_ext run CONFIG OUT`` starts W processes that
each run ``mergekit-ext run``; they read the ``torch.distributed`` environment
(``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and join one
process group: gloo on CPU, NCCL for CUDA tensors (with gloo beside it for the small
control messages) where ``--device cuda`` puts rank r on ``cuda:LOCAL_RANK``.

Rank r owns the tasks ``{k : k mod W = r}`` (:meth:`DistributedContext.owned`); the
sequential executor runs those tasks' forward passes and statistics there and combines the
statistics with the collectives below. Only rank 0 writes anything.

Every collective is bounded by the process group's timeout (``--distributed-timeout``,
default :data:`DEFAULT_TIMEOUT_S`); a rank that fails exits at once, which closes its
connections, so the others fail in their next collective instead of waiting. The
collectives here turn those failures into a :class:`DistributedError` naming the rank.

Without ``WORLD_SIZE`` (or with ``WORLD_SIZE=1``) nothing is initialised and every helper
is the identity: a single process runs exactly the code it always ran.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch

from mergekit_ext.errors import MergekitExtError

LOG = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800.0


class DistributedError(MergekitExtError):
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

    def owner(self, task_index: int) -> int:
        return task_index % self.world_size

    def owned(self, num_tasks: int) -> list[int]:
        """The indices of this rank's tasks: ``{k : k mod W = rank}``."""
        return [k for k in range(num_tasks) if self.owner(k) == self.rank]

    def check_tasks(self, num_tasks: int) -> None:
        if self.world_size > num_tasks:
            raise DistributedError(
                f"{self.world_size} processes for {num_tasks} tasks: each process owns whole "
                f"tasks, so launch at most {num_tasks} (--nproc-per-node {num_tasks})"
            )

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
        timeout_s: bound of every collective (and of the rendezvous), seconds.

    Returns:
        The context, also returned by :func:`current` from now on.
    """
    global _CURRENT
    timeout = float(timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    if timeout <= 0:
        raise DistributedError(f"--distributed-timeout must be > 0 seconds; got {timeout}")
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
    try:
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
            init_method="env://",
            world_size=world,
            rank=rank,
            timeout=timedelta(seconds=timeout),
        )
        # Pickled control messages stay on CPU even when the tensors go through NCCL.
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) if cuda else None
    except (RuntimeError, ValueError) as e:
        raise DistributedError(
            f"rank {rank}/{world}: joining the process group at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']} failed within {timeout:g} s: {e}"
        ) from e
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
