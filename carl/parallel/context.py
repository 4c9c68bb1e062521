"""The process layout of a run: rank, world size, device and the few collectives the trainer itself needs.

``torchrun --nproc_per_node=N -m carl.train ...`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; :func:`init_distributed` reads them and joins the default process group (NCCL on CUDA, gloo on
CPU). Without those variables the run is a single process and every helper here is a cheap no-op, so the
single-process code path is unchanged.

Every collective issued through :meth:`DistContext.guard` turns a backend failure (a peer that died, a peer that
hung past ``parallel.timeout_s``) into a :class:`DistributedError` that names this rank and the operation.
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

BACKENDS = ("auto", "gloo", "nccl")
# Substrings of backend errors that mean "a peer is gone or stuck" rather than a bug in our code.
_PEER_FAILURE_HINTS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "closed", "broken pipe", "socket")


class DistributedError(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or the backend refused the operation."""


class DistContext:
    """Rank, world size and device of this process, plus the collectives used outside the gradient sync."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0, backend: str | None = None,
                 timeout_s: float = 1800.0, local_world_size: int | None = None) -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.local_world_size = local_world_size or world_size  # ranks on this node (torchrun: LOCAL_WORLD_SIZE)
        self.backend = backend  # None when single-process
        self.timeout_s = timeout_s

    # -- properties ------------------------------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- error handling --------------------------------------------------------------------------------------------
    @contextmanager
    def guard(self, op: str) -> Iterator[None]:
        """Run a block of collectives; re-raise peer failures as :class:`DistributedError` naming rank and op."""
        start = time.perf_counter()
        try:
            yield
        except DistributedError:
            raise
        except RuntimeError as exc:  # DistBackendError is a RuntimeError subclass
            if not self.distributed:
                raise
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if not isinstance(exc, dist.DistBackendError) and not any(h in text.lower() for h in _PEER_FAILURE_HINTS):
                raise
            waited = time.perf_counter() - start
            raise DistributedError(
                f"rank {self.rank}/{self.world_size}: collective '{op}' failed after {waited:.1f}s "
                f"(parallel.timeout_s={self.timeout_s:g}): a peer rank died or hung; backend said: {text}"
            ) from exc

    # -- collectives used by the trainer ---------------------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor, op: str = "all_reduce") -> torch.Tensor:
        """In-place sum over ranks (identity with one process)."""
        if self.distributed:
            with self.guard(op):
                dist.all_reduce(tensor)
        return tensor

    def broadcast_object(self, obj: T, op: str = "broadcast") -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        with self.guard(op):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj: Any, op: str = "gather") -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self.guard(op):
            dist.all_gather_object(out, obj)
        return out

    def gather_to_main(self, obj: Any, op: str = "gather") -> list[Any]:
        """Every rank's ``obj`` in rank order on rank 0 (other ranks get ``[]``): for checkpoint state."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        with self.guard(op):
            dist.gather_object(obj, out, dst=0)
        return out or []

    def any(self, flag: bool, op: str = "stop flag") -> bool:
        """True on every rank if ``flag`` is true on any rank (used to stop all ranks at the same update)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        if self.backend == "nccl":
            t = t.cuda()
        self.all_reduce_sum(t, op)
        return bool(t.item() > 0)

    def run_on_main(self, fn: Callable[[], T], op: str) -> T:
        """Run ``fn`` on rank 0 only and hand its result (or its exception) to every rank."""
        result: Any = None
        error: BaseException | None = None
        if self.is_main:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
                error = exc
        result, error = self.broadcast_object((result, error), op)
        if error is not None:
            raise error
        return result

    def reduce_metrics(self, stats: dict[str, float]) -> dict[str, float]:
        """Mean over ranks of every logged scalar; episode means are weighted by episode counts, counts summed."""
        if not self.distributed:
            return stats
        all_stats = self.gather_objects(stats, "metrics")
        out: dict[str, float] = {}
        keys = sorted({k for s in all_stats for k in s})
        for key in keys:
            vals = [(s[key], s.get("episode/count", 0.0)) for s in all_stats if key in s]
            if key == "episode/count":
                out[key] = float(sum(v for v, _ in vals))
            elif key.startswith("episode/") and sum(w for _, w in vals) > 0:
                out[key] = float(sum(v * w for v, w in vals) / sum(w for _, w in vals))
            else:
                out[key] = float(sum(v for v, _ in vals) / len(vals))
        return out

    def barrier(self, op: str = "barrier") -> None:
        if self.distributed:
            with self.guard(op):
                dist.barrier()

    def shutdown(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def leave_rank(code: int | str | None) -> None:
    """End a torchrun rank: the exit handlers run (logging, CARLA servers), then the process leaves without the
    interpreter's finalisation.

    Why: DDP keeps its process group alive after ``destroy_process_group`` (torch 2.13: the three gloo threads of
    the group are still running at exit, measured), and a gloo thread that touches a Python object while the
    interpreter finalises aborts the rank ("terminate called without an active exception"), which torchrun reports
    as a failed run although training finished and every file was written."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_as_rank(command: Callable[[], Any]) -> None:
    """Run a command; in a torchrun rank (``WORLD_SIZE`` > 1) its exit goes through :func:`leave_rank`."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        command()
        return
    try:
        command()
    except SystemExit as exc:
        leave_rank(exc.code)


def pick_backend(requested: str, device: torch.device) -> str:
    """``auto``: NCCL for CUDA devices, gloo otherwise. Refuse NCCL on CPU."""
    if requested not in BACKENDS:
        raise ValueError(f"parallel.backend={requested!r} must be one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ValueError("parallel.backend=nccl needs CUDA devices; use parallel.backend=gloo (or auto) on CPU")
    return requested


def init_distributed(device_request: str, backend: str = "auto", timeout_s: float = 1800.0) -> tuple[DistContext, torch.device]:
    """Join the process group described by torchrun's environment (or stay single-process).

    Returns the context and this rank's device: ``cuda:<LOCAL_RANK>`` when CUDA is used, else ``cpu``.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_request.startswith("cuda") or (device_request == "auto" and torch.cuda.is_available())
    if world <= 1:
        dev = device_request if device_request != "auto" else ("cuda" if use_cuda else "cpu")
        return DistContext(timeout_s=timeout_s), torch.device(dev)
    if use_cuda:
        if device_request.startswith("cuda:"):
            raise ValueError(f"parallel.device={device_request!r}: with torchrun each rank uses cuda:<LOCAL_RANK>; "
                             "use parallel.device=cuda (or auto)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    be = pick_backend(backend, device)
    if not dist.is_initialized():
        dist.init_process_group(be, timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if be == "nccl" else {}))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return DistContext(rank, world, local_rank, be, timeout_s, local_world), device
