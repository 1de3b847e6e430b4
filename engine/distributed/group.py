"""One tensor-parallel group's communication: a torch.distributed process group (gloo on CPU, NCCL on
CUDA) made from its own TCPStore, not the process-global default group, so one process can hold
several engines one after another (tests) and nothing else in it is affected.

Every collective waits at most `timeout` seconds: a rank that died or hangs ends the step with an
error (the engine loop then dies and GET /health answers 503) instead of a hang. The time spent
inside collectives is summed (`seconds`) for the benchmark's share of a step in communication.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

# How long one collective (and the rendezvous) may wait for the other ranks.
COLLECTIVE_TIMEOUT_S = 120.0


class Group:
    def __init__(self, rank: int, size: int, device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 prefix: str = "", address: str = "127.0.0.1"):
        self.prefix = prefix  # a sub-group's name in its parent's store (a pipeline stage's TP group)
        self.address = address  # where this rank's gloo listens: the other ranks connect to it
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.pg = None
        self.store = None
        self.seconds = 0.0  # spent in collectives
        self.calls = 0

    def open_store(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Rank 0: the rendezvous store (port 0: a free one; it listens on every interface); returns its
        port for the other ranks."""
        from torch.distributed import TCPStore

        self.store = TCPStore(host, port, self.size, self.rank == 0, timeout=self.timeout, wait_for_workers=False)
        return self.store.port

    def connect(self, host: str = "127.0.0.1", port: int | None = None, parent: Group | None = None) -> None:
        """Join the group (every member calls it; it returns once all have, or raises after the timeout).
        With `parent`: a sub-group of the parent's ranks, rendezvousing under its prefix in the parent's store."""
        import torch.distributed as dist

        if parent is not None:
            self.store = dist.PrefixStore(self.prefix, parent.store)
        elif self.store is None:
            self.store = dist.TCPStore(host, port, self.size, False, timeout=self.timeout)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(self.store, self.rank, self.size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.address)]
            options._timeout = self.timeout
            self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.size, options)
        self.barrier()

    def _wait(self, work) -> None:
        if not work.wait(self.timeout):
            raise TimeoutError(f"a tensor-parallel collective waited over {self.timeout.total_seconds():.0f} s "
                               "for the other ranks")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns the tensor."""
        start = time.perf_counter()
        tensor = tensor.contiguous()
        self._wait(self.pg.allreduce([tensor]))
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor [N, k], joined along the last dimension: [N, size * k]."""
        start = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(self.pg.allgather([parts], [tensor]))
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return torch.cat(parts, dim=-1)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point to point (a pipeline stage's output to the next stage)."""
        start = time.perf_counter()
        self._wait(self.pg.send([tensor.contiguous()], dst, 0))
        self.seconds += time.perf_counter() - start
        self.calls += 1

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> _Sending:
        """An asynchronous send (a pipeline micro-batch's output): wait() on the result before the
        tensor may change; the wait has the collectives' timeout."""
        tensor = tensor.contiguous()
        return _Sending(self, self.pg.send([tensor], dst, tag), tensor)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int = 0) -> torch.Tensor:
        start = time.perf_counter()
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(self.pg.recv([tensor], src, tag))
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return tensor

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def close(self) -> None:
        self.pg = None
        self.store = None


class _Sending:
    def __init__(self, group: Group, work, tensor: torch.Tensor):
        self.group, self.work, self.tensor = group, work, tensor  # the tensor lives until delivered

    def wait(self) -> None:
        start = time.perf_counter()
        self.group._wait(self.work)
        self.group.seconds += time.perf_counter() - start
        self.group.calls += 1
        self.tensor = None
