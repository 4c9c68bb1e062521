"""Policy bundles: a trained actor packaged for use outside the trainer, and :func:`load_policy`.

A bundle is a directory::

    policy.ts             TorchScript actor: (bev, measurements) -> (action, alpha, beta); a set policy's takes its
                          inputs instead (measurements, route, lanes, vehicles, pedestrians, statics, stops)
    policy.onnx           the same graph in ONNX (dynamic batch dimension)
    weights.safetensors   every weight of the actor-critic (CarlPolicy.state_dict())
    config.yaml           the training config the checkpoint was saved with
    spec.json             observations, actions, BEV geometry, model signature, versions, file hashes

The exported actor takes ``bev`` ([B, C, H, W], uint8 0..255 by default, or float32 0..255 when exported with
``bev_dtype=float32``) and ``measurements`` ([B, M] float32) and returns the deterministic action (the Beta mean
mapped to [-1, 1], [B, 2]) and the Beta parameters ``alpha`` and ``beta`` ([B, 2], both > 1).

A set-encoder policy (``model.name=set``, the vector observation) takes ``measurements`` and the entity sets
(``envs.api.VECTOR_FEATURES``: [B, count, features] float32, the validity flag last) in the order ``spec["inputs"]``
lists; its spec carries ``vector_geometry`` (the sizes the env must use) where a BEV policy's carries ``bev_geometry``.

``spec.json`` names what the numbers mean: ``observation_layout`` (``carla``: CaRL's CARLA observation, 10 channels
and 8 measurements; ``nuplan``: CaRL's nuPlan observation, 9 channels and 10 measurements; see ``envs.api.LAYOUTS``),
the BEV ``channels``, the measurement and value-measurement ``fields`` and the action ``fields`` in order (CARLA:
steer, longitudinal; CaRL's nuPlan variant: accel, steer) with their scaling. A bundle written before these keys
existed is the CARLA layout (:func:`observation_layout`, :func:`action_names` read either).

:func:`load_policy` accepts a bundle directory (``zoo:<name>``: one that ships, :mod:`carl.zoo`) or a training
checkpoint (``.pt``) and returns a callable
``obs dict -> action tensor [B, 2]`` plus the spec; it is the one entry point for the CARLA leaderboard agent, the
nuPlan planner adapter and ``carl-eval``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from carl import zoo
from carl.checkpoint import CheckpointError, load_checkpoint, signature_differences
from carl.config import MODEL_NAMES
from carl.policy import ActorCritic, CarlPolicy, beta_mean_action, beta_sample, make_policy
from carl.spec import (BUNDLE_FORMAT, BUNDLE_VERSION, FILES, ONNX_INPUTS, ONNX_OUTPUTS, control_dt_of, make_spec,
                       sha256_file)
from envs.api import ACTIONS, LAYOUT_CARLA, OBS_BEV, OBS_MEASUREMENTS, TensorSpec

PolicyFn = Callable[[dict[str, torch.Tensor]], torch.Tensor]
PRECISIONS = {"float32": torch.float32, "float64": torch.float64}  # a loaded policy's arithmetic (load_policy)


def precision_problem(precision: object) -> str | None:
    """The message for a ``precision`` that is not one of ``PRECISIONS`` (None when it is one)."""
    return None if precision in PRECISIONS else f"precision={precision}: use {' or '.join(PRECISIONS)}"


class BundleError(RuntimeError):
    """A bundle that is missing, incomplete or belongs to another model/version; the message names the path."""


# ------------------------------------------------------------------------------------------------------------------
# The exported actor
# ------------------------------------------------------------------------------------------------------------------
class Actor(nn.Module):
    """The policy half of :class:`CarlPolicy` with positional tensor inputs (what TorchScript and ONNX export)."""

    def __init__(self, policy: ActorCritic) -> None:
        super().__init__()
        self.policy = policy
        self.inputs = policy.INPUTS  # the positional inputs, in order

    def forward(self, bev: torch.Tensor, measurements: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        alpha, beta = self.policy.actor({OBS_BEV: bev, OBS_MEASUREMENTS: measurements})
        return beta_mean_action(alpha, beta), alpha, beta


class SetActor(Actor):
    """The policy half of the set policy (``model.name=set``) with positional inputs: the measurements, then the
    sets."""

    def forward(self, measurements: torch.Tensor, route: torch.Tensor, lanes: torch.Tensor,  # type: ignore[override]
                vehicles: torch.Tensor, pedestrians: torch.Tensor, statics: torch.Tensor, stops: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        alpha, beta = self.policy.actor({OBS_MEASUREMENTS: measurements, "route": route, "lanes": lanes,
                                         "vehicles": vehicles, "pedestrians": pedestrians, "statics": statics,
                                         "stops": stops})
        return beta_mean_action(alpha, beta), alpha, beta


def actor_for(policy: ActorCritic) -> Actor:
    """The exportable actor of ``policy``: positional inputs in the order its ``INPUTS`` say."""
    return Actor(policy) if isinstance(policy, CarlPolicy) else SetActor(policy)


def actor_inputs(spec: dict[str, Any]) -> tuple[str, ...]:
    """The actor's inputs in order (``spec["inputs"]``; bundles written before it: bev, measurements)."""
    return tuple(spec.get("inputs") or ONNX_INPUTS)


# ------------------------------------------------------------------------------------------------------------------
# Rebuilding a policy from a checkpoint
# ------------------------------------------------------------------------------------------------------------------
def _observation_spec(obs_shapes: dict[str, list[int]], layout: dict[str, list[str]] | None = None
                      ) -> dict[str, TensorSpec]:
    dtypes = {OBS_BEV: torch.uint8}
    names = layout or {}
    return {k: TensorSpec(tuple(v), dtypes.get(k, torch.float32), names=tuple(names.get(k, ())))
            for k, v in obs_shapes.items()}


def build_policy(obs_shapes: dict[str, list[int]], model_cfg: dict[str, Any], where: str,
                 layout: dict[str, list[str]] | None = None) -> ActorCritic:
    """A fresh network (:func:`carl.policy.make_policy`) for these observation shapes and ``model`` config; ``where`` names the source;
    ``layout``: the names of the inputs and actions (the signature's ``layout``; None for files written before)."""
    name = model_cfg.get("name", "carl")
    if name not in MODEL_NAMES:
        raise CheckpointError(f"{where} holds model {name!r}; this code rebuilds only {', '.join(MODEL_NAMES)}")
    try:
        return make_policy(_observation_spec(obs_shapes, layout), tuple((layout or {}).get("actions", ())), model_cfg)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{where}: cannot rebuild the model ({exc})") from None


def _check_signature(policy: ActorCritic, saved: dict, where: str) -> None:
    """The rebuilt model must have the saved layer plan (else the code's stride rule or widths changed)."""
    mine = policy.signature()
    diffs = [f"{k}: file has {saved.get(k)}, this code builds {mine.get(k)}"
             for k in ("obs_shapes", "conv", "num_params") if k in saved and saved.get(k) != mine.get(k)]
    if diffs:
        raise CheckpointError(f"{where} belongs to another model or carl version: " + "; ".join(diffs))


def _load_weights(policy: ActorCritic, state: dict[str, torch.Tensor], where: str) -> None:
    missing, unexpected = [], []
    mine = policy.state_dict()
    missing = sorted(set(mine) - set(state))
    unexpected = sorted(set(state) - set(mine))
    shapes = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(v.shape)}"
              for k, v in mine.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append("shape mismatch " + "; ".join(shapes[:5]))
        raise CheckpointError(f"{where} belongs to another model: " + ", ".join(parts))
    policy.load_state_dict(state)


def load_initial_weights(policy: ActorCritic, source: str | Path) -> str:
    """Copy the weights of a checkpoint or bundle (``zoo:<name>``) into ``policy`` (``init_from``: fine-tuning).

    Raises :class:`CheckpointError` / :class:`BundleError` naming the file when it holds another model, observation
    layout or action layout; returns a line saying what was loaded."""
    try:
        path = Path(zoo.resolve(str(source)))
    except zoo.ZooError as exc:
        raise BundleError(str(exc).replace("policy=", "init_from=", 1)) from None
    if path.is_dir():
        where = f"init_from={source} (bundle {path})"
        spec = read_spec(path)
        saved, state = spec["model"]["signature"], _bundle_weights(path, spec)
    else:
        where = f"init_from={source}"
        if not path.exists():
            raise CheckpointError(f"{where}: {path} does not exist (give a checkpoint .pt file, a bundle directory "
                                  "or zoo:<name>)")
        ckpt = load_checkpoint(path, map_location="cpu")
        saved, state = ckpt["signature"], ckpt["model"]
    diffs = signature_differences(policy.signature(), saved)
    if diffs:
        raise CheckpointError(f"{where} does not fit this run's model and observation: " + "; ".join(diffs)
                              + "; train with the env options and model it was trained with (its config)")
    _load_weights(policy, state, where)  # load_state_dict casts (a bf16 file into fp32 parameters)
    return f"initial weights from {path}"


def policy_from_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[ActorCritic, dict[str, Any]]:
    """Load a training checkpoint into a fresh network (eval mode); return it and the checkpoint dict.

    Raises :class:`CheckpointError` naming the file for an unreadable file, another format version, another model
    name, a layer plan this code no longer builds, or weights that do not fit.
    """
    path = Path(path)
    ckpt = load_checkpoint(path, map_location="cpu")
    signature = ckpt.get("signature") or {}
    if "obs_shapes" not in signature:
        raise CheckpointError(f"checkpoint {path} has no model signature (obs_shapes); it was not written by carl-train")
    config = ckpt.get("config") or {}
    policy = build_policy(signature["obs_shapes"], config.get("model", {}), f"checkpoint {path}",
                          signature.get("layout"))
    _check_signature(policy, signature, f"checkpoint {path}")
    _load_weights(policy, ckpt["model"], f"checkpoint {path}")
    return policy.to(device).eval(), ckpt


# ------------------------------------------------------------------------------------------------------------------
# TorchScript and ONNX: quiet
# ------------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def quiet_export() -> Any:
    """Silence the exporters' deprecation warnings and optional-dependency log lines (torchvision ops)."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


# ------------------------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------------------------
def read_spec(bundle: str | Path) -> dict[str, Any]:
    """``spec.json`` of a bundle, checked for format and version."""
    path = Path(bundle) / FILES["spec"]
    if not path.is_file():
        raise BundleError(f"{bundle} is not a policy bundle: {path.name} is missing (export one with carl-export)")
    try:
        spec = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path} is not valid JSON ({exc}); export the bundle again with carl-export") from None
    if not isinstance(spec, dict) or spec.get("format") != BUNDLE_FORMAT:
        found = spec.get("format") if isinstance(spec, dict) else type(spec).__name__
        raise BundleError(f"{path} is not a carl policy bundle (format {found!r})")
    if spec.get("bundle_version") != BUNDLE_VERSION:
        raise BundleError(f"{path} has bundle version {spec.get('bundle_version')}, this code reads version "
                          f"{BUNDLE_VERSION}; re-export it with this carl version")
    model = spec.get("model")
    if not isinstance(spec.get("files"), dict) or not isinstance(model, dict) or \
            not isinstance(model.get("signature"), dict) or "obs_shapes" not in model["signature"]:
        raise BundleError(f"{path} is incomplete (needs files and model.signature.obs_shapes); export the bundle "
                          "again with carl-export")
    return spec


def observation_layout(spec: dict[str, Any]) -> str:
    """The observation layout a bundle's policy expects (``envs.api.LAYOUTS`` key): ``carla`` for bundles written
    before the key existed."""
    return str(spec.get("observation_layout", LAYOUT_CARLA))


def action_names(spec: dict[str, Any]) -> tuple[str, ...]:
    """The names of the policy's action components in output order (``("steer", "longitudinal")`` for bundles
    written before they were recorded)."""
    fields = (spec.get("actions") or {}).get("fields") or []
    names = tuple(f["name"] for f in fields if isinstance(f, dict) and "name" in f)
    return names or ACTIONS


def remedy(bundle: Path) -> str:
    """How to get an intact copy of a damaged bundle: a shipped zoo policy is restored from the repository, any other
    is exported again."""
    here = Path(bundle).resolve()
    if not here.is_relative_to(zoo.ZOO_DIR):
        return "export it again with carl-export"
    return f"restore the shipped files (git checkout -- {here.relative_to(zoo.ZOO_DIR.parent.parent)}, or a fresh clone)"


def bundle_file(bundle: Path, spec: dict[str, Any], kind: str) -> Path:
    """The path of the bundle's ``kind`` file (weights, torchscript, onnx), checked against the sha256 that
    ``spec.json`` records, so a truncated, swapped or damaged file is named before anything reads it."""
    name = (spec.get("files") or {}).get(kind)
    if name is None:
        raise BundleError(f"bundle {bundle} has no {kind} file (spec.json lists {sorted(spec.get('files') or {})})")
    path = bundle / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise BundleError(f"bundle {bundle}: spec.json names {kind} file {name!r} outside the bundle folder")
    if not path.is_file():
        raise BundleError(f"bundle {bundle} lacks {name}; {remedy(bundle)}")
    want = (spec.get("sha256") or {}).get(name)
    if want is not None and sha256_file(path) != want:
        raise BundleError(f"bundle {bundle}: {name} does not match the sha256 in spec.json (damaged or replaced "
                          f"after export); {remedy(bundle)}")
    return path


def _policy_from_bundle(bundle: Path, device: str | torch.device) -> ActorCritic:
    spec = read_spec(bundle)
    signature = spec["model"]["signature"]
    where = f"bundle {bundle}"
    policy = build_policy(signature["obs_shapes"], spec["model"], where, signature.get("layout"))
    _check_signature(policy, signature, where)
    _load_weights(policy, _bundle_weights(bundle, spec), where)
    return policy.to(device).eval()


def _bundle_weights(bundle: Path, spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The bundle's safetensors weights, checked against spec.json's sha256."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = bundle_file(bundle, spec, "weights")
    try:
        return load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise BundleError(f"bundle {bundle}: {weights.name} is not a safetensors file ({exc}); "
                          f"{remedy(bundle)}") from None


@dataclass
class LoadedPolicy:
    """``obs dict -> action [B, 2]`` (components in the order of ``action_names(spec)``): Beta mean
    (``deterministic``) or a Beta sample. ``spec`` describes the inputs."""

    spec: dict[str, Any]
    device: torch.device
    deterministic: bool = True
    actor: nn.Module | None = None  # torch or TorchScript actor
    session: Any = None  # onnxruntime.InferenceSession

    def distribution(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(deterministic action, alpha, beta) for a batch of observations."""
        inputs = actor_inputs(self.spec)
        missing = [k for k in inputs if k not in obs]
        if missing:
            raise BundleError(f"the policy reads {list(inputs)} (observation layout {observation_layout(self.spec)}); "
                              f"the observation lacks {missing}: build the env with the policy's observation")
        u8 = self.spec["observations"].get(OBS_BEV, {}).get("dtype") == "uint8"
        feeds = [obs[k].to(torch.uint8) if k == OBS_BEV and u8 else obs[k].float() for k in inputs]
        if self.session is not None:
            outs = self.session.run(list(ONNX_OUTPUTS), {k: v.cpu().numpy() for k, v in zip(inputs, feeds)})
            action, alpha, beta = (torch.from_numpy(o).to(obs[OBS_MEASUREMENTS].device) for o in outs)
            return action, alpha, beta
        assert self.actor is not None
        with torch.no_grad():
            return self.actor(*(x.to(self.device) for x in feeds))

    def __call__(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        action, alpha, beta = self.distribution(obs)
        return action if self.deterministic else beta_sample(alpha, beta)


def load_policy(path: str | Path, device: str | torch.device = "cpu", deterministic: bool = True,
                backend: str = "torch", precision: str = "float32") -> tuple[LoadedPolicy, dict[str, Any]]:
    """Load a bundle directory (``zoo:<name>``: a shipped one, :mod:`carl.zoo`) or a ``.pt`` checkpoint; return
    ``(policy, spec)``.

    ``policy(obs)`` maps an observation dict (``bev`` [B, C, H, W], ``measurements`` [B, M]; the layout
    :func:`observation_layout` names) to actions [B, 2] in [-1, 1] (:func:`action_names` order). ``backend``:
    ``torch`` (rebuild :class:`CarlPolicy` from the weights; bundle or checkpoint), ``torchscript`` or ``onnx``
    (bundle only: run ``policy.ts`` / ``policy.onnx``). ``precision`` (``PRECISIONS``; the torch backend only): the
    arithmetic of the network, whose output is float32 either way; in float64 the actions do not follow the last bits
    of the BLAS kernel's float32 sums, which differ between CPUs and MKL code paths (docs/evaluation.md).
    """
    if problem := precision_problem(precision):
        raise ValueError(problem)
    if precision != "float32" and backend != "torch":
        raise ValueError(f"precision={precision} needs backend=torch: the {backend} graph was exported in float32")
    try:
        path = Path(zoo.resolve(str(path)))
    except zoo.ZooError as exc:
        raise BundleError(str(exc)) from None
    device, dtype = torch.device(device), PRECISIONS[precision]
    if path.is_dir():
        spec = read_spec(path)
        if backend == "torch":
            policy = _policy_from_bundle(path, device).to(dtype)
            return LoadedPolicy(spec, device, deterministic, actor=actor_for(policy)), spec
        if backend == "torchscript":
            script = bundle_file(path, spec, "torchscript")
            try:
                with quiet_export():
                    actor = torch.jit.load(str(script), map_location=device).eval()
            except RuntimeError as exc:
                raise BundleError(f"bundle {path}: {script.name} is not a TorchScript archive "
                                  f"({str(exc).strip().splitlines()[0]}); {remedy(path)}") from None
            return LoadedPolicy(spec, device, deterministic, actor=actor), spec
        if backend == "onnx":
            try:
                import onnxruntime as ort
            except ImportError:
                raise BundleError("backend=onnx needs onnxruntime: pip install -e '.[export]'") from None
            if "onnx" not in spec["files"]:
                raise BundleError(f"bundle {path} was exported without ONNX")
            graph = bundle_file(path, spec, "onnx")
            try:
                session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
            except Exception as exc:  # noqa: BLE001 - onnxruntime's own error types
                raise BundleError(f"bundle {path}: {graph.name} is not an ONNX model ({str(exc).splitlines()[0]}); "
                                  f"{remedy(path)}") from None
            return LoadedPolicy(spec, device, deterministic, session=session), spec
        raise ValueError(f"backend={backend!r}: use torch, torchscript or onnx")
    if not path.exists():
        raise CheckpointError(f"policy {path} does not exist (give a checkpoint .pt file or a bundle directory)")
    if backend != "torch":
        raise ValueError(f"backend={backend!r} needs a bundle directory; {path} is a checkpoint (run carl-export)")
    policy, ckpt = policy_from_checkpoint(path, device)
    policy.to(dtype)
    source = {"checkpoint": str(path.resolve()), "update": ckpt.get("update"), "global_step": ckpt.get("global_step")}
    spec = make_spec(policy, ckpt.get("config") or {}, source, control_dt=control_dt_of(ckpt))
    return LoadedPolicy(spec, device, deterministic, actor=actor_for(policy)), spec


def random_observations(spec: dict[str, Any], batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random actor inputs matching ``spec``: BEV uniform in 0..255, measurements standard normal, entity sets
    standard normal with a random validity flag (padding rows zero)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key in actor_inputs(spec):
        shape = spec["observations"][key]["shape"]
        if key == OBS_BEV:
            out[key] = torch.randint(0, 256, (batch, *shape), generator=gen, dtype=torch.uint8)
        elif len(shape) == 2:  # an entity set, validity flag last
            x = torch.randn(batch, *shape, generator=gen)
            valid = (torch.rand(batch, shape[0], 1, generator=gen) < 0.7).float()
            out[key] = torch.cat((x[..., :-1], torch.ones_like(valid)), -1) * valid
        else:
            out[key] = torch.randn(batch, *shape, generator=gen)
    return out


def check_bundle(bundle: str | Path, reference: str | Path | None = None, batch: int = 8, seed: int = 0
                 ) -> dict[str, float]:
    """Largest absolute difference of (action, alpha, beta) between each backend of ``bundle`` and ``reference``
    (the source checkpoint; default the bundle's own weights), on ``batch`` random observations."""
    bundle = Path(bundle)
    ref, spec = load_policy(reference if reference is not None else bundle)
    obs = random_observations(read_spec(bundle), batch, seed)
    want = ref.distribution(obs)
    diffs: dict[str, float] = {}
    backends = ["torch", "torchscript"] + (["onnx"] if "onnx" in read_spec(bundle)["files"] else [])
    for backend in backends:
        got = load_policy(bundle, backend=backend)[0].distribution(obs)
        diffs[backend] = max(float((g.cpu() - w.cpu()).abs().max()) for g, w in zip(got, want))
    return diffs


__all__ = ["Actor", "BundleError", "PRECISIONS", "SetActor", "precision_problem", "actor_for", "actor_inputs", "LoadedPolicy", "action_names", "check_bundle", "load_policy",
           "observation_layout", "policy_from_checkpoint", "random_observations", "read_spec", "sha256_file"]
