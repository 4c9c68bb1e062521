"""Bytes and seconds spent synchronising gradients, as logged scalars.

"Bytes sent" is the payload one rank hands to its collectives per optimiser step (the all-reduce input, or its
share of an all-gather): the ``S`` of the usual ring cost model ``T ~ 2 (N-1)/N * S / bandwidth``. The
compression ratio compares it with the fp32 all-reduce of the same gradient. With ``parallel.hierarchical`` these
are the bytes a node leader sends to the other nodes (other ranks send none and report no byte figures, so the
logged mean over ranks is per node); the node's own all-reduce and broadcast are ``sync/intra_node_bytes_*``.
"""
from __future__ import annotations

import threading


class SyncStats:
    """Thread-safe counters (gloo completes futures on its own threads); ``pop()`` returns and resets them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.bytes_sent = 0
        self.bytes_fp32 = 0
        self.bytes_intra = 0
        self.seconds = 0.0
        self.steps = 0

    def add(self, bytes_sent: int, bytes_fp32: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.bytes_sent += int(bytes_sent)
            self.bytes_fp32 += int(bytes_fp32)
            self.seconds += seconds

    def add_intra(self, bytes_sent: int) -> None:
        """Bytes of the exact all-reduce inside a node (hierarchical sync)."""
        with self._lock:
            self.bytes_intra += int(bytes_sent)

    def add_time(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds

    def step(self) -> None:
        with self._lock:
            self.steps += 1

    def pop(self) -> dict[str, float]:
        """``sync/*`` scalars since the last pop (empty if nothing was synchronised)."""
        with self._lock:
            if self.steps == 0 and self.bytes_sent == 0:
                self.reset()
                return {}
            steps = max(1, self.steps)
            out = {"sync/steps": float(self.steps), "sync/seconds": self.seconds}
            if self.bytes_sent or not self.bytes_intra:  # hierarchical non-leaders send nothing between nodes
                out.update({
                    "sync/bytes_per_step": self.bytes_sent / steps,
                    "sync/bytes_per_update": float(self.bytes_sent),
                    "sync/compression_ratio": self.bytes_fp32 / self.bytes_sent if self.bytes_sent else 1.0,
                })
            if self.bytes_intra:
                out["sync/intra_node_bytes_per_update"] = float(self.bytes_intra)
            self.reset()
            return out
