"""``carl-export`` / ``python -m carl.export``: a training checkpoint -> a policy bundle (format: :mod:`carl.bundle`).

Usage::

    carl-export checkpoint=runs/quick-20250101-120000/best.pt               # -> runs/quick-.../bundle-best
    carl-export checkpoint=runs/quick-.../last.pt out_dir=bundles/quick bev_dtype=float32
    carl-export checkpoint=... onnx_exporter=torchscript overwrite=true
    carl-export --cfg                                   # print the composed config and exit

After writing, the TorchScript and ONNX graphs are compared with the checkpoint on random observations
(``check=true``); a difference above 1e-4 is an error (exit code 1). Bad input exits with code 2.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from carl.bundle import BundleError, check_bundle, export_bundle
from carl.checkpoint import CheckpointError
from carl.config import ConfigError
from carl.evaluate import compose

PARITY_TOL = 1e-4


def run(cfg: dict[str, Any], log: Callable[[str], None] = print) -> int:
    """Export ``cfg['checkpoint']``; return the exit code (0, or 1 if the parity check fails)."""
    ckpt = Path(str(cfg["checkpoint"]))
    out = Path(cfg["out_dir"]) if cfg.get("out_dir") else ckpt.parent / f"bundle-{ckpt.stem}"
    spec = export_bundle(ckpt, out, bev_dtype=cfg.get("bev_dtype", "uint8"), onnx=bool(cfg.get("onnx", True)),
                         onnx_exporter=cfg.get("onnx_exporter", "dynamo"), overwrite=bool(cfg.get("overwrite", False)))
    g = spec["bev_geometry"]
    log(f"bundle {out}: {', '.join(sorted(spec['files'].values()))} | bev {spec['observations']['bev']['shape']} "
        f"{spec['observations']['bev']['dtype']} ({g['metres_ahead']:.0f} m ahead, {g['metres_behind']:.0f} m behind) | "
        f"{spec['model']['signature']['num_params']:,} params")
    if not cfg.get("check", True):
        return 0
    diffs = check_bundle(out, ckpt)
    log("parity vs checkpoint (max |diff| of action, alpha, beta): " + json.dumps({k: f"{v:.2e}" for k, v in diffs.items()}))
    bad = {k: v for k, v in diffs.items() if not v <= PARITY_TOL}
    if bad:
        log(f"parity check FAILED (tolerance {PARITY_TOL}): {bad}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        sys.exit(0)
    try:
        cfg = compose("export", [a for a in argv if a != "--cfg"])
        if "--cfg" in argv:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.create(cfg)))
            sys.exit(0)
        if cfg.get("checkpoint") in (None, "???"):
            raise ConfigError("checkpoint=<path to a .pt checkpoint> is required")
        code = run(cfg)
    except (ConfigError, CheckpointError, BundleError, ValueError) as exc:
        print(f"carl-export error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code)


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    main()
