"""Pictures for humans: colourise BEV observations, add text overlays, write GIF/PNG/MP4 files.

Nothing here is on the training hot path; it works on single frames as numpy arrays.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from envs.api import BEV_CHANNELS
from envs.sim.config import SimConfig
from envs.sim.bev_draw import BevConfig

__all__ = ["BEV_CHANNELS", "BEV_COLOURS", "bev_to_rgb", "overlay_text", "write_frames"]

# RGB colour of each channel of ``BEV_CHANNELS`` at full intensity (value 255).
BEV_COLOURS = np.array([
    (90, 90, 90),  # road: grey
    (60, 120, 200),  # route: blue
    (250, 250, 250),  # lane markings: white
    (40, 200, 80),  # vehicles: green
    (230, 120, 200),  # pedestrians: pink
    (230, 40, 40),  # traffic lights: red
    (250, 150, 20),  # stop sign: orange
    (150, 90, 220),  # speed signs: purple
    (140, 100, 60),  # static objects: brown
    (70, 70, 110),  # shoulder: slate
], dtype=np.uint8)
# Channels painted first (so later ones are drawn over them): road and shoulder under everything else.
_PAINT_ORDER = (0, 9, 1, 2, 7, 6, 5, 8, 4, 3)
EGO_COLOUR = np.array((250, 220, 0), np.uint8)
_BACKGROUND = np.array((15, 15, 15), np.uint8)


def bev_to_rgb(bev: torch.Tensor | np.ndarray, cfg: BevConfig | None = None,
               ego_half_extent: tuple[float, float] | None = None) -> np.ndarray:
    """Colourise one BEV observation uint8 ``[C, H, W]`` into RGB ``[H, W, 3]``.

    Channels are painted in a fixed order (road and shoulder first) over a dark background, each with its colour from
    :data:`BEV_COLOURS` scaled by the pixel value (values below 255, e.g. broken markings or speed-encoded actors,
    appear dimmer but never vanish: intensity = 0.35 + 0.65 * value / 255). The ego box (half length, half width in
    metres; default the simulator's, ``SimConfig.ego_half_extent``) is drawn at its fixed place (``cfg`` geometry;
    defaults to CaRL's). Fewer than 10 channels are allowed.
    """
    a = bev.detach().cpu().numpy() if isinstance(bev, torch.Tensor) else np.asarray(bev)
    if a.ndim != 3:
        raise ValueError(f"bev must be [C, H, W], got shape {a.shape}")
    c, h, w = a.shape
    img = np.empty((h, w, 3), np.float32)
    img[:] = _BACKGROUND
    for ch in _PAINT_ORDER:
        if ch >= c:
            continue
        v = a[ch].astype(np.float32)
        on = v > 0
        if not on.any():
            continue
        colour = BEV_COLOURS[ch % len(BEV_COLOURS)].astype(np.float32)
        img[on] = colour * (0.35 + 0.65 * v[on, None] / 255.0)
    cfg = cfg or BevConfig(size=h)
    if ego_half_extent is None:
        ego_half_extent = SimConfig().ego_half_extent
    hl, hw = ego_half_extent[0] * cfg.ppm, ego_half_extent[1] * cfg.ppm
    r0, c0 = cfg.ego_row, cfg.ego_col
    r_lo, r_hi = int(round(r0 - hl)), int(round(r0 + hl))
    c_lo, c_hi = int(round(c0 - hw)), int(round(c0 + hw))
    img[max(r_lo, 0):max(r_hi + 1, 0), max(c_lo, 0):max(c_hi + 1, 0)] = EGO_COLOUR
    return img.clip(0, 255).astype(np.uint8)


def overlay_text(img: np.ndarray, lines: list[str], colour: tuple[int, int, int] = (255, 255, 255)) -> np.ndarray:
    """Write ``lines`` at the top-left of ``img`` (uint8 ``[H, W, 3]``) with PIL's default font on a dark box.

    Returns a new array; ``img`` is not modified.
    """
    pil = Image.fromarray(np.ascontiguousarray(img, dtype=np.uint8))
    draw = ImageDraw.Draw(pil)
    font = ImageFont.load_default()
    text = "\n".join(lines)
    if text:
        box = draw.multiline_textbbox((3, 2), text, font=font)
        draw.rectangle((0, 0, box[2] + 3, box[3] + 3), fill=(0, 0, 0))
        draw.multiline_text((3, 2), text, font=font, fill=colour)
    return np.asarray(pil)


def _has_ffmpeg() -> bool:
    """Whether imageio can write MP4 (needs the imageio-ffmpeg plugin)."""
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


def write_frames(frames: list[np.ndarray], path: Path | str, fps: int = 10) -> Path:
    """Write RGB frames (uint8 ``[H, W, 3]``) to ``path`` and return the path actually written.

    ``.png``: the first frame only (a single still). ``.gif``: an animation via PIL. ``.mp4``: via imageio when its
    ffmpeg plugin is installed; otherwise a ``.gif`` next to it is written instead and a note is printed to stderr.
    """
    if not frames:
        raise ValueError("write_frames needs at least one frame")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = [np.ascontiguousarray(f, dtype=np.uint8) for f in frames]
    suffix = path.suffix.lower()
    if suffix == ".png":
        Image.fromarray(arrays[0]).save(path)
        return path
    if suffix == ".mp4":
        if _has_ffmpeg():
            import imageio.v2 as imageio

            imageio.mimwrite(path, arrays, fps=fps, macro_block_size=1)
            return path
        path = path.with_suffix(".gif")
        print(f"write_frames: imageio has no ffmpeg plugin, writing {path} instead of .mp4", file=sys.stderr)
    elif suffix != ".gif":
        raise ValueError(f"write_frames writes .gif, .png or .mp4, not '{path.suffix}' ({path})")
    images = [Image.fromarray(a) for a in arrays]
    images[0].save(path, save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)), loop=0)
    return path
