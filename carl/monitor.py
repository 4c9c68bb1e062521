"""Everything the user sees while training: phase timers, episode statistics, the progress bar, the per-update
summary line, TensorBoard scalars/videos and the BEV video recorder.

Phases (seconds per update): ``env`` (env.step), ``inference`` (policy forward during the rollout), ``update``
(GAE + gradient steps), ``sync`` (cross-process communication; always 0 with one process), ``eval`` and
``checkpoint`` (only on updates where they happen).
"""
from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

import numpy as np
import torch

from envs.api import OBS_BEV

PHASES = ("env", "inference", "update", "sync")


class PhaseTimer:
    """Accumulates wall time per named phase; ``pop()`` returns and clears the totals."""

    def __init__(self, cuda_sync: bool = False) -> None:
        self.cuda_sync = cuda_sync  # synchronise CUDA at phase ends so GPU work is charged to its phase
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda_sync:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = {p: 0.0 for p in PHASES}
        out.update(self.totals)
        self.totals = defaultdict(float)
        return out


class EpisodeStats:
    """Collects ``info["episode/..."]`` of finished rows and summarises them.

    Every ``episode/*`` key is averaged over finished episodes. Keys under ``episode/infractions/`` are in addition
    reported per km (sum of counts / sum of ``episode/km``) as ``episode/infractions_per_km/<type>``.
    """

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = defaultdict(list)
        self.count = 0

    def add(self, info: dict[str, torch.Tensor], finished: torch.Tensor) -> None:
        if not bool(finished.any()):
            return
        rows = finished.nonzero(as_tuple=True)[0]
        self.count += int(rows.numel())
        for key, val in info.items():
            if key.startswith("episode/") and isinstance(val, torch.Tensor) and val.dim() >= 1:
                self.values[key].extend(val[rows].float().reshape(rows.numel(), -1)[:, 0].cpu().tolist())

    def add_episode(self, stats: dict[str, float]) -> None:
        """Add one finished episode given as a flat ``{"episode/...": value}`` dict."""
        self.count += 1
        for key, val in stats.items():
            self.values[key].append(float(val))

    def summary(self) -> dict[str, float]:
        out = {k: float(np.mean(v)) for k, v in self.values.items() if v}
        km = sum(self.values.get("episode/km", []))
        if "episode/km" in self.values:
            for key, vals in self.values.items():
                if key.startswith("episode/infractions/"):
                    name = key.split("/", 2)[2]
                    out[f"episode/infractions_per_km/{name}"] = float(sum(vals) / km) if km > 0 else 0.0
        out["episode/count"] = float(self.count)
        return out

    def clear(self) -> None:
        self.values.clear()
        self.count = 0


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class ProgressBar:
    """A one-line, ``\\r``-updated progress bar on stderr (only when stderr is a terminal, or when forced)."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None, width: int = 24) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled and (stream is not None or self.stream.isatty())
        self.total, self.width = total, width
        self._last_draw = 0.0
        self._shown = False

    def update(self, done: int, sps: float, extra: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < 0.25:
            return
        self._last_draw = now
        frac = min(1.0, done / max(1, self.total))
        filled = int(frac * self.width)
        eta = (self.total - done) / sps if sps > 0 else float("inf")
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r[{bar}] {frac * 100:5.1f}% {done:,}/{self.total:,} samples {sps:,.0f}/s ETA {_fmt_duration(eta)} {extra}\x1b[K")
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        """Erase the bar so a normal line can be printed."""
        if self.enabled and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


def _f(d: dict[str, float], key: str, fmt: str = "{:.1f}") -> str:
    return fmt.format(d[key]) if key in d else "-"


def summary_line(update: int, num_updates: int, global_step: int, sps: float, stats: dict[str, float]) -> str:
    """One readable line per update: progress, episode metrics, losses and phase times."""
    return (
        f"update {update}/{num_updates} | samples {global_step:,} | SPS {sps:,.0f} | "
        f"return {_f(stats, 'episode/return', '{:.2f}')} RC {_f(stats, 'episode/route_completion')} "
        f"DS {_f(stats, 'episode/driving_score')} eps {int(stats.get('episode/count', 0))} | "
        f"pg {_f(stats, 'losses/policy_loss', '{:+.3f}')} v {_f(stats, 'losses/value_loss', '{:.3f}')} "
        f"ent {_f(stats, 'losses/entropy', '{:.2f}')} kl {_f(stats, 'losses/approx_kl', '{:.4f}')} "
        f"clip {_f(stats, 'losses/clipfrac', '{:.2f}')} ev {_f(stats, 'losses/explained_variance', '{:.2f}')}"
        + (f" bc {_f(stats, 'losses/bc_loss', '{:.3f}')}" if "time/teacher" in stats else "") + " | "
        f"env {_f(stats, 'time/env', '{:.1f}')}s inf {_f(stats, 'time/inference', '{:.1f}')}s "
        + (f"teacher {_f(stats, 'time/teacher', '{:.1f}')}s " if "time/teacher" in stats else "")
        + f"upd {_f(stats, 'time/update', '{:.1f}')}s sync {_f(stats, 'time/sync', '{:.1f}')}s"
    )


class TBLogger:
    """TensorBoard writer under ``<run dir>/tb``; on resume ``purge_step`` drops events past the checkpoint."""

    def __init__(self, log_dir: Path, enabled: bool = True, purge_step: int | None = None) -> None:
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for key, val in values.items():
            if isinstance(val, (int, float)) and math.isfinite(val):
                self.writer.add_scalar(tb_name(key), val, step)

    def video(self, tag: str, frames: np.ndarray, step: int, fps: int, gif_path: Path) -> str:
        """Add ``frames`` [T, H, W, 3] uint8 as a video if moviepy is available, else write a GIF + first frame."""
        try:
            import moviepy  # noqa: F401

            if self.writer is not None:
                vid = torch.from_numpy(frames).permute(0, 3, 1, 2).unsqueeze(0)
                self.writer.add_video(tag, vid, step, fps=fps)
            return "tensorboard video"
        except ImportError:
            import imageio.v2 as imageio

            gif_path.parent.mkdir(parents=True, exist_ok=True)
            imageio.mimsave(gif_path, list(frames), duration=1.0 / fps, loop=0)
            if self.writer is not None:
                self.writer.add_image(tag + "/first_frame", frames[0], step, dataformats="HWC")
            return str(gif_path)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def tb_name(key: str) -> str:
    """Map internal keys to TensorBoard tags: ``episode/return`` -> ``charts/episode_return`` etc."""
    if key.startswith("episode/"):
        rest = key[len("episode/"):]
        if rest.startswith(("infractions/", "infractions_per_km/", "termination/")):
            return rest
        return "charts/episode_" + rest
    return key


def format_eval_table(results: dict[str, dict[str, Any]]) -> str:
    """Side-by-side table of evaluation results (one column per policy)."""
    names = list(results)
    rows = [("driving_score", "DS"), ("route_completion", "RC"), ("infraction_score", "IS"), ("episodes", "episodes")]
    if any("closed_loop_score" in r for r in results.values()):  # nuPlan: its closed-loop score first
        rows.insert(0, ("closed_loop_score", "CLS"))
    head = f"{'metric':<12}" + "".join(f"{n:>12}" for n in names)
    lines = [head, "-" * len(head)]
    for key, label in rows:
        cells = []
        for n in names:
            v = results[n].get(key)
            cells.append(f"{v:>12.3f}" if isinstance(v, float) else f"{v!s:>12}")
        lines.append(f"{label:<12}" + "".join(cells))
    return "\n".join(lines)


class VideoRecorder:
    """Records env 0's BEV for one whole episode (starting at its next reset) when armed."""

    def __init__(self, max_frames: int) -> None:
        self.max_frames = max_frames
        self.render: Callable[[Any], np.ndarray] | None = None
        try:
            from envs.sim.render import bev_to_rgb  # type: ignore[import-not-found]

            self.render = bev_to_rgb
        except ImportError:
            pass
        self.state = "idle"  # idle -> waiting (for env 0's reset) -> recording -> ready
        self.frames: list[np.ndarray] = []
        self.update = 0

    def arm(self, update: int) -> None:
        if self.render is not None and self.state == "idle":
            self.state, self.frames, self.update = "waiting", [], update

    def on_step(self, obs: dict[str, torch.Tensor], done: torch.Tensor) -> None:
        if self.state == "recording":
            self.frames.append(np.asarray(self.render(obs[OBS_BEV][0].cpu().numpy())))  # type: ignore[misc]
            if bool(done[0]) or len(self.frames) >= self.max_frames:
                self.state = "ready"
        elif self.state == "waiting" and bool(done[0]):
            self.state = "recording"
            self.frames = [np.asarray(self.render(obs[OBS_BEV][0].cpu().numpy()))]  # type: ignore[misc]

    def take(self) -> np.ndarray | None:
        if self.state != "ready":
            return None
        self.state = "idle"
        return np.stack(self.frames).astype(np.uint8)
