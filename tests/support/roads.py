"""Hand-built roads for tests whose expectations are computed from the map by hand."""
from __future__ import annotations

import numpy as np


def straight(x0: float, x1: float, y: float) -> np.ndarray:
    """A lane centre along y = ``y`` from x0 to x1 (either way), one point per metre."""
    x = np.linspace(x0, x1, int(round(abs(x1 - x0))) + 1)
    return np.stack([x, np.full_like(x, y)], 1)
