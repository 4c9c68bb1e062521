"""``carl-export`` / ``python -m carl.export``: a training checkpoint -> a policy bundle (format: :mod:`carl.bundle`).

Usage::

    carl-export checkpoint=runs/quick-20250101-120000/best.pt               # -> runs/quick-.../bundle-best
    carl-export checkpoint=runs/quick-.../last.pt out_dir=bundles/quick bev_dtype=float32
    carl-export checkpoint=... onnx_exporter=torchscript overwrite=true
    carl-export --cfg                                   # print the composed config and exit
    carl-export checkpoint=runs/quick-.../best.pt hydra.run.dir=bundles/quick     # the bundle in bundles/quick

After writing, the TorchScript and ONNX graphs are compared with the checkpoint on random observations
(``check=true``); a difference above 1e-4 is an error (exit code 1). Bad input exits with code 2.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from carl.bundle import (Actor, BundleError, actor_for, check_bundle, policy_from_checkpoint, quiet_export,
                         random_observations)
from carl.spec import (BUNDLE_FORMAT, FILES, ONNX_OUTPUTS, carl_version, control_dt_of, make_spec, sha256_file)
from carl.checkpoint import CheckpointError
from carl.cli import Command, run_command
from carl.config import ConfigError
from envs.api import OBS_BEV

PARITY_TOL = 1e-4


@dataclass
class ExportConfig:
    """``carl-export``'s keys and defaults (``conf/export.yaml``)."""

    checkpoint: str = "???"  # required: a carl-train checkpoint (.pt), e.g. runs/quick-.../best.pt
    out_dir: str | None = None  # default <checkpoint folder>/bundle-<checkpoint name>
    bev_dtype: str = "uint8"  # dtype of the ONNX/TorchScript bev input: uint8 (as the envs give it) or float32 (0..255)
    onnx: bool = True  # write policy.onnx
    onnx_exporter: str = "dynamo"  # dynamo (torch.export) or torchscript (legacy exporter, faster)
    overwrite: bool = False  # replace the files of a non-empty out_dir
    check: bool = True  # compare the exported graphs with the checkpoint on random observations


# ------------------------------------------------------------------------------------------------------------------
# Writing a bundle
# ------------------------------------------------------------------------------------------------------------------
def _example_inputs(actor: Actor, spec: dict[str, Any], batch: int, bev_dtype: str) -> tuple[torch.Tensor, ...]:
    """Random inputs in the actor's positional order (the BEV in the dtype the bundle takes)."""
    obs = random_observations(spec, batch)
    return tuple(obs[k].float() if k == OBS_BEV and bev_dtype == "float32" else obs[k] for k in actor.inputs)


def export_onnx(actor: Actor, example: tuple[torch.Tensor, ...], path: Path, exporter: str = "dynamo",
                opset: int = 18) -> None:
    """Write ``actor`` as ONNX with a dynamic batch dimension (``exporter``: dynamo or the legacy torchscript one)."""
    names = list(actor.inputs)
    if exporter == "dynamo":
        batch = torch.export.Dim("batch")
        program = torch.onnx.export(actor, example, input_names=names, output_names=list(ONNX_OUTPUTS),
                                    dynamic_shapes={name: {0: batch} for name in names}, dynamo=True,
                                    opset_version=opset, verbose=False)
        program.save(str(path))
    elif exporter == "torchscript":
        axes = {name: {0: "batch"} for name in (*names, *ONNX_OUTPUTS)}
        torch.onnx.export(actor, example, str(path), input_names=names, output_names=list(ONNX_OUTPUTS),
                          dynamic_axes=axes, dynamo=False, opset_version=min(opset, 17))
    else:
        raise ValueError(f"onnx exporter {exporter!r}: use 'dynamo' or 'torchscript'")


def export_bundle(checkpoint: str | Path, out_dir: str | Path, bev_dtype: str = "uint8", onnx: bool = True,
                  onnx_exporter: str = "dynamo", overwrite: bool = False) -> dict[str, Any]:
    """Checkpoint -> bundle directory (the format: :mod:`carl.bundle`); returns the spec written to ``spec.json``."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    if bev_dtype not in ("uint8", "float32"):
        raise ValueError(f"bev_dtype={bev_dtype!r}: use uint8 or float32")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise BundleError(f"bundle folder {out} is not empty; pick another folder or pass overwrite=true")
    policy, ckpt = policy_from_checkpoint(checkpoint, "cpu")  # a bad checkpoint leaves the folder untouched
    if out.exists():
        for name in FILES.values():  # no stale file of an earlier export may survive next to the new spec
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    policy = policy.float()
    config = ckpt.get("config") or {}
    actor = actor_for(policy).eval()
    source = {"checkpoint": str(Path(checkpoint).resolve()), "checkpoint_sha256": sha256_file(checkpoint),
              "update": ckpt.get("update"), "global_step": ckpt.get("global_step"),
              "provenance": (ckpt.get("extra") or {}).get("provenance")}  # command, commit, CPU, seconds (zoo cards)
    spec = make_spec(policy, config, source, bev_dtype, control_dt_of(ckpt))
    example = _example_inputs(actor, spec, 2, bev_dtype)

    state = {k: v.detach().contiguous().clone() for k, v in policy.state_dict().items()}
    save_file(state, str(out / FILES["weights"]), metadata={"format": BUNDLE_FORMAT, "carl_version": carl_version()})
    with quiet_export():
        with torch.no_grad():
            traced = torch.jit.trace(actor, example)
        traced.save(str(out / FILES["torchscript"]))
        if onnx:
            try:
                export_onnx(actor, example, out / FILES["onnx"], onnx_exporter)
            except ImportError as exc:
                raise BundleError(f"ONNX export needs the export extra ({exc}): pip install -e '.[export]', "
                                  "or pass onnx=false") from None
    OmegaConf.save(OmegaConf.create(config), out / FILES["config"])
    if not onnx:
        spec["files"].pop("onnx")
    spec["sha256"] = {name: sha256_file(out / name) for name in spec["files"].values()}
    (out / FILES["spec"]).write_text(json.dumps(spec, indent=2) + "\n")
    return spec


def run(cfg: dict[str, Any], log: Callable[[str], None] = print) -> int:
    """Export ``cfg['checkpoint']``; return the exit code (0, or 1 if the parity check fails)."""
    if cfg.get("checkpoint") in (None, "???"):
        raise ConfigError("checkpoint=<path to a .pt checkpoint> is required")
    ckpt = Path(str(cfg["checkpoint"]))
    out = Path(cfg["out_dir"]) if cfg.get("out_dir") else ckpt.parent / f"bundle-{ckpt.stem}"
    spec = export_bundle(ckpt, out, bev_dtype=cfg.get("bev_dtype", "uint8"), onnx=bool(cfg.get("onnx", True)),
                         onnx_exporter=cfg.get("onnx_exporter", "dynamo"), overwrite=bool(cfg.get("overwrite", False)))
    log(f"bundle {out}: {', '.join(sorted(spec['files'].values()))} | {_inputs_line(spec)} | "
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


def _inputs_line(spec: dict[str, Any]) -> str:
    """What the actor reads, for the log: the BEV and its view, or the entity sets and their sizes."""
    obs = spec["observations"]
    if "bev_geometry" in spec:
        g = spec["bev_geometry"]
        return (f"bev {obs[OBS_BEV]['shape']} {obs[OBS_BEV]['dtype']} ({g['metres_ahead']:.0f} m ahead, "
                f"{g['metres_behind']:.0f} m behind)")
    return "vector " + ", ".join(f"{k} {obs[k]['shape']}" for k in spec["inputs"])


class ExportCommand(Command):
    """``carl-export`` for :func:`carl.cli.run_command`: the bundle goes to ``out_dir``, else ``hydra.run.dir`` if
    given, else ``<checkpoint folder>/bundle-<checkpoint name>``."""

    name = "export"
    folder_key = "out_dir"
    schemas = {"export_schema": ExportConfig}  # noqa: RUF012
    error = ("carl-export error", 2, "")
    errors = {ConfigError: error, CheckpointError: error, BundleError: error, ValueError: error}  # noqa: RUF012

    def run(self, cfg: dict[str, Any]) -> int:
        return run(cfg)

    def default_folder(self, cfg: dict[str, Any]) -> str | None:
        if cfg.get("checkpoint") in (None, "???"):
            return None
        ckpt = Path(str(cfg["checkpoint"]))
        return str(ckpt.parent / f"bundle-{ckpt.stem}")

    def check(self, cfg: dict[str, Any]) -> list[str]:
        if cfg.get("checkpoint") in (None, "???"):
            return ["checkpoint=<path to a .pt checkpoint> is required"]
        if not Path(str(cfg["checkpoint"])).is_file():
            return [f"checkpoint={cfg['checkpoint']}: {cfg['checkpoint']} does not exist (pass a carl-train "
                    "checkpoint, e.g. runs/<run>/best.pt)"]
        return []


def main(argv: list[str] | None = None) -> None:
    run_command(ExportCommand(), argv)


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    from carl.export import main as _main  # this module under its own name (jobs pickled for a cluster import it)

    _main()
