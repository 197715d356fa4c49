"""The ranks' agreement on each step of a collective write: JSON exchanges, never pickle.

:meth:`Comm.agree` runs a step on every rank of the default process group, then every rank's
outcome is exchanged (``all_gather`` of JSON bytes in a ``uint8`` tensor: no object is
unpickled, unlike ``all_gather_object``). If the step failed on any rank, every rank raises
:class:`~memtree.errors.DistributedCheckpointError` naming each failed rank and its error, so
the ranks always leave a step together. If the exchange itself fails (a rank killed with
``kill -9``: its connections close and the others notice at once; a hung rank: the process
group's ``timeout``), every surviving rank raises the same error.

The tensors of an exchange live where the backend takes them: the CPU for gloo (and a
``"cpu:gloo,cuda:nccl"`` group), the current CUDA device for NCCL.

Example:
    >>> import torch.distributed as dist
    >>> dist.is_initialized()   # Comm.default() needs an initialised default process group
    False
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import torch

from ..errors import DistributedCheckpointError, InvalidArgumentError

__all__ = ["Comm", "MAX_ERROR_CHARS"]

#: Most characters of one rank's error kept in a message (the rest is cut).
MAX_ERROR_CHARS = 2000


class Comm:
    """The default process group, as the steps of a collective write use it.

    Attributes:
        rank: this process's rank.
        world: the number of ranks.
        device: where the tensors of an exchange are made.
    """

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank = rank
        self.world = world
        self.device = device

    @classmethod
    def default(cls, what: str) -> Comm:
        """The default process group.

        Raises:
            InvalidArgumentError: ``torch.distributed`` is not initialised (``what`` says who
                needs it).
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgumentError(
                f"{what}: torch.distributed is not initialised. Call "
                "torch.distributed.init_process_group(...) on every rank first"
            )
        backend = str(dist.get_backend())
        if "gloo" in backend or "nccl" not in backend:
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(dist.get_rank(), dist.get_world_size(), device)

    # -- exchanges ----------------------------------------------------------------------------

    def _lost(self, step: str, err: BaseException, done: str | None) -> DistributedCheckpointError:
        after = done or "Nothing was committed: the destination is as it was"
        return DistributedCheckpointError(
            f"{step}: the ranks could not exchange their outcomes ({type(err).__name__}: "
            f"{str(err)[:MAX_ERROR_CHARS]}): a rank died, or hung past the process group's timeout, "
            f"or left the collective. {after}"
        )

    def _sizes(self, data: bytes) -> list[int]:
        import torch.distributed as dist

        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        dist.all_gather(sizes, size)
        return [int(s.item()) for s in sizes]

    def _padded(self, data: bytes, most: int) -> torch.Tensor:
        buf = torch.zeros(max(most, 1), dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return buf.to(self.device)

    def exchange(self, step: str, payload: Any, *, done: str | None = None) -> list[Any]:
        """Every rank's ``payload`` (JSON), in rank order, on every rank.

        Raises:
            DistributedCheckpointError: the exchange failed (a rank died or hung); ``done``
                replaces the message's last sentence (what was committed).
        """
        import torch.distributed as dist

        data = orjson.dumps(payload)
        try:
            sizes = self._sizes(data)
            buf = self._padded(data, max(sizes))
            out = [torch.empty_like(buf) for _ in range(self.world)]
            dist.all_gather(out, buf)
        except Exception as err:  # noqa: BLE001 - gloo/NCCL errors: a lost rank
            raise self._lost(step, err, done) from err
        return [orjson.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(out, sizes)]

    def gather(self, step: str, payload: Any) -> list[Any] | None:
        """Every rank's ``payload`` (JSON), in rank order, on rank 0 (``None`` on the others).

        Raises:
            DistributedCheckpointError: the exchange failed (a rank died or hung).
        """
        import torch.distributed as dist

        data = orjson.dumps(payload)
        try:
            sizes = self._sizes(data)
            buf = self._padded(data, max(sizes))
            out = [torch.empty_like(buf) for _ in range(self.world)] if self.rank == 0 else None
            dist.gather(buf, out, dst=0)
        except Exception as err:  # noqa: BLE001 - gloo/NCCL errors: a lost rank
            raise self._lost(step, err, None) from err
        if out is None:
            return None
        return [orjson.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(out, sizes)]

    # -- steps --------------------------------------------------------------------------------

    def agree(self, step: str, work: Callable[[], Any], *, done: Callable[[], str | None] | None = None) -> list[Any]:
        """Run ``work`` on this rank, then learn every rank's outcome: what each rank's ``work``
        returned (JSON), in rank order, when it succeeded on every rank.

        Args:
            step: what the step does, for messages (``"writing the shards"``).
            work: the step on this rank; returns a JSON value (or ``None``).
            done: when the exchange fails after ``work`` committed something, what to say
                about it (``None``: nothing was committed).

        Raises:
            DistributedCheckpointError: ``work`` failed on some rank (``failures`` maps each
                failed rank to its error: this rank's own exception, a
                ``DistributedCheckpointError`` with the text of another's), or the exchange
                failed. In a group of one rank, ``work``'s own error is raised as it is.
        """
        error: BaseException | None = None
        try:
            mine: dict[str, Any] = {"ok": True, "value": work()}
        except BaseException as err:  # noqa: BLE001 - reported to every rank, then raised
            error = err
            mine = {"ok": False, "error": f"{type(err).__name__}: {err}"[:MAX_ERROR_CHARS]}
        try:
            outcomes = self.exchange(step, mine, done=done() if done is not None and error is None else None)
        except DistributedCheckpointError:
            if error is not None and not isinstance(error, Exception):
                raise error from None  # an interrupt stays an interrupt
            raise
        if error is not None and (self.world == 1 or not isinstance(error, Exception)):
            raise error  # an interrupt, or the error of a process alone in its group: as it is
        failed = {r: o["error"] for r, o in enumerate(outcomes) if not o["ok"]}
        if failed:
            lines = "; ".join(f"rank {r}: {text}" for r, text in sorted(failed.items()))
            failures: dict[int, BaseException] = {
                r: error if r == self.rank and error is not None else DistributedCheckpointError(f"rank {r}: {text}")
                for r, text in failed.items()
            }
            raise DistributedCheckpointError(
                f"{step} failed on {len(failed)} of {self.world} rank(s): {lines}. Nothing was "
                "committed: the destination is as it was",
                failures,
            ) from error
        return [o["value"] for o in outcomes]
