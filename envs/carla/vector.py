"""N CARLA workers, one subprocess and one CARLA server each, behind :class:`envs.api.BatchedEnv`.

Each worker process owns one env of :func:`envs.carla.worker.build_carla_env` (and, with ``launch``, its
:class:`envs.carla.servers.CarlaServer` on a port block the parent allocated, so blocks never clash). Workers run in
their own processes because the ``carla`` client aborts its whole process on malformed data or errors in its
background threads. Crashes inside a worker (server death, client time-outs) are handled by the worker itself; if a
worker *process* dies, the parent kills its server's process group, starts a fresh worker on the same ports,
truncates that row's episode and counts the restart. Observations and rewards come back as numpy arrays and are
stacked into tensors on the trainer's device.

Process lifetime: workers are daemon processes that watch their parent and, when it dies, stop their server and exit;
a worker's server runs under the watchdog launcher of :mod:`envs.carla.servers`, so it also dies with its worker. The
env is registered for the main process's exit and SIGTERM (:func:`envs.carla.servers.track`); ``close()`` (also as a
context manager) stops workers and servers.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from envs.api import BatchedEnv, StepResult, TensorSpec
from envs.carla.servers import (CarlaServer, PortAllocator, PortBlock, kill_group, read_pid_file, resolve_executable,
                                track, untrack)
from envs.carla.config import CarlaConfig, split_options
from envs.carla.worker import CarlaError
from envs.sim.config import SimConfig

log = logging.getLogger(__name__)

READY_SLACK = 120.0  # seconds on top of the server's ready_timeout for a worker to come up (map compile, routes)
PARENT_POLL_S = 0.2  # how often a worker checks that the main process is alive


def _to_numpy(d: dict[str, Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in d.items()}


def _watch_parent(main_pid: int, owned: list[CarlaServer | None]) -> None:
    """Worker thread: when the main process is gone, stop this worker's server and end the worker at once.

    The parent changes (re-parented to init or a subreaper) when the main process dies, also by SIGKILL; with the
    ``forkserver`` start method the parent is the fork server, so the main process's pid is checked as well."""
    parent = os.getppid()
    while True:
        time.sleep(PARENT_POLL_S)
        gone = os.getppid() != parent
        if not gone and parent != main_pid:
            try:
                os.kill(main_pid, 0)
            except ProcessLookupError:
                gone = True
            except PermissionError:
                pass
        if gone:
            server = owned[0]
            try:
                if server is not None:
                    server.stop(grace=2.0)
            finally:
                os._exit(1)


def _worker_main(conn: Connection, ccfg: CarlaConfig, scfg: SimConfig, block: PortBlock, seed: int,
                 main_pid: int | None = None) -> None:
    """Worker process: start the server (if launching), build the worker, then serve reset/step/close requests."""
    owned: list[CarlaServer | None] = [None]
    if main_pid is not None:  # first of all: a worker never outlives the main process
        threading.Thread(target=_watch_parent, args=(main_pid, owned), daemon=True, name="carla-parent-watch").start()
    from envs.carla.worker import build_carla_env  # noqa: PLC0415 - imported in the child

    server = None
    env = None
    expert = None
    try:
        if ccfg.launch:
            server = CarlaServer(resolve_executable(ccfg.executable), block, log_dir=Path(ccfg.log_dir),
                                 host=ccfg.host, gpu=(ccfg.gpus[seed % len(ccfg.gpus)] if ccfg.gpus else None),
                                 no_rendering=ccfg.no_rendering, extra_args=ccfg.extra_args,
                                 ready_timeout=ccfg.ready_timeout, check_version=ccfg.check_version)
            owned[0] = server
            server.start()
            conn.send(("server", server.proc.pid))
            server.wait_ready()
        env = build_carla_env(ccfg, scfg, block.rpc, block.tm, "cpu", seed, server)
        conn.send(("ready", {"spec": {k: (v.shape, str(v.dtype), v.low, v.high, v.names)
                                      for k, v in env.observation_spec.items()},
                             "route_names": env.route_names, "route_lengths": env.route_lengths,
                             "max_episode_steps": env.max_episode_steps}))
        while True:
            cmd, arg = conn.recv()
            if cmd == "reset":
                conn.send(("ok", _to_numpy(env.reset(arg))))
            elif cmd == "step":
                r = env.step(torch.as_tensor(arg).unsqueeze(0))
                conn.send(("ok", (_to_numpy(r.obs), r.reward.numpy(), r.terminated.numpy(), r.truncated.numpy(),
                                  _to_numpy(r.info))))
            elif cmd == "state":
                conn.send(("ok", env.state_dict()))
            elif cmd == "expert":  # the simulator's rule-based expert on this worker's mirrored state
                if expert is None:
                    from envs.sim.expert import Expert  # noqa: PLC0415 - only evaluation asks for it

                    expert = Expert(env)
                conn.send(("ok", expert().numpy()))
            elif cmd == "close":
                break
    except (EOFError, KeyboardInterrupt):
        pass
    except Exception as e:  # noqa: BLE001 - report everything to the parent, which raises it
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except OSError:
            pass
    finally:
        try:
            if env is not None:
                env.close()
        finally:
            if server is not None:  # also a server the worker restarted (new pid): never leak one
                server.kill()


class CarlaVectorEnv(BatchedEnv):
    """``num_envs`` CARLA workers stepped together; tensors on ``device``; automatic reset (inside each worker)."""

    def __init__(self, ccfg: CarlaConfig, scfg: SimConfig, num_envs: int, device: str | torch.device = "cpu",
                 seed: int = 0):
        if num_envs < 1:
            raise ValueError(f"num_envs={num_envs}: need at least one environment")
        self.ccfg, self.scfg = ccfg.validate(), scfg.validate()
        self.num_envs, self.device, self.seed = num_envs, torch.device(device), seed
        if ccfg.launch:
            resolve_executable(ccfg.executable)  # fail fast, before any process starts
            self.blocks = PortAllocator(ccfg.base_port, ccfg.port_stride, host=ccfg.host).allocate_many(num_envs)
        else:  # external servers: server i listens on base_port + i * port_stride
            self.blocks = [PortBlock.at(ccfg.base_port + i * ccfg.port_stride) for i in range(num_envs)]
        self.ctx = mp.get_context(ccfg.start_method)
        self.procs: list[Any] = [None] * num_envs
        self.conns: list[Connection | None] = [None] * num_envs
        self.server_pids: list[int | None] = [None] * num_envs
        self.process_restarts = 0
        self.row_restarts = np.zeros(num_envs, np.float32)  # worker-process restarts per row
        self._info_template: dict[str, np.ndarray] | None = None  # zeros shaped like one row's info
        self._closed = False
        self._started = time.time()
        track(self)  # closed at interpreter exit; workers and servers stopped on SIGTERM
        try:
            for i in range(num_envs):
                self._spawn(i)
            ready = [self._await_ready(i) for i in range(num_envs)]
        except BaseException:
            self.close()
            raise
        self.observation_spec = {k: TensorSpec(tuple(shape), getattr(torch, dtype.split(".")[-1]), low, high,
                                               tuple(names))
                                 for k, (shape, dtype, low, high, names) in ready[0]["spec"].items()}
        self.route_names: list[str] = ready[0]["route_names"]  # every route of the town, by route id
        self.route_lengths: list[float] = ready[0]["route_lengths"]
        self.control_dt = scfg.dt
        self.max_episode_steps: int = max(r["max_episode_steps"] for r in ready)

    # ------------------------------------------------------------------ processes
    def _spawn(self, i: int) -> None:
        parent, child = self.ctx.Pipe()
        # worker i of N drives routes first_route + i, + N, ... (+ route_stride where given: DDP ranks share the file)
        scfg = dataclasses.replace(self.scfg, first_route=self.scfg.first_route + i,
                                   route_stride=self.scfg.route_stride or self.num_envs)
        p = self.ctx.Process(target=_worker_main, args=(child, self.ccfg, scfg, self.blocks[i], self.seed + i,
                                                        os.getpid()), daemon=True, name=f"carla-worker-{i}")
        p.start()
        child.close()
        self.procs[i], self.conns[i], self.server_pids[i] = p, parent, None

    def _await_ready(self, i: int) -> dict:
        timeout = self.ccfg.ready_timeout + READY_SLACK
        while True:
            kind, payload = self._recv(i, timeout)
            if kind == "server":
                self.server_pids[i] = payload
            elif kind == "ready":
                return payload
            else:
                raise CarlaError(f"CARLA worker {i} (port {self.blocks[i].rpc}) failed to start: {payload}")

    def _recv(self, i: int, timeout: float | None = None) -> tuple[str, Any]:
        conn = self.conns[i]
        if timeout is not None and not conn.poll(timeout):
            raise CarlaError(f"CARLA worker {i} (port {self.blocks[i].rpc}) gave no answer within {timeout:.0f} s")
        msg = conn.recv()  # EOFError if the process died
        if msg[0] == "error":
            raise CarlaError(f"CARLA worker {i} (port {self.blocks[i].rpc}): {msg[1]}")
        return msg

    def _replace(self, i: int) -> dict[str, np.ndarray]:
        """A worker process died: kill its server's process group, start a new worker, return its first obs."""
        self.process_restarts += 1
        self.row_restarts[i] += 1
        log.warning("CARLA worker %d died; restarting it (process restart #%d)", i, self.process_restarts)
        for pgid in self._server_groups(i):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.procs[i].join(timeout=5.0)
        self._spawn(i)
        self._await_ready(i)
        self.conns[i].send(("reset", self.seed + 7919 * self.process_restarts + i))
        return self._recv(i)[1]

    # ------------------------------------------------------------------ BatchedEnv
    def _stack(self, rows: list[dict[str, np.ndarray]]) -> dict[str, Tensor]:
        return {k: torch.as_tensor(np.concatenate([r[k] for r in rows])).to(self.device) for k in rows[0]}

    def reset(self, seed: int | None = None) -> dict[str, Tensor]:
        if seed is not None:
            self.seed = seed
        for i, c in enumerate(self.conns):
            c.send(("reset", None if seed is None else seed + i))
        return self._stack([self._recv(i)[1] for i in range(self.num_envs)])

    def expert_actions(self) -> Tensor:
        """Every worker's rule-based expert action for its current state, ``[num_envs, 2]`` on ``device``."""
        lost = (EOFError, ConnectionResetError, BrokenPipeError)  # a dead worker: brake; step() replaces it
        asked = []
        for c in self.conns:
            try:
                c.send(("expert", None))
                asked.append(True)
            except lost:
                asked.append(False)
        rows = []
        for i in range(self.num_envs):
            try:
                rows.append(self._recv(i)[1] if asked[i] else None)
            except lost:
                rows.append(None)
        stop = np.array([[0.0, -1.0]], np.float32)  # (steer, throttle/brake): full brake
        return torch.as_tensor(np.concatenate([r if r is not None else stop for r in rows])).to(self.device)

    def step(self, action: Tensor) -> StepResult:
        action = torch.as_tensor(action, dtype=torch.float32)
        if action.shape != (self.num_envs, 2):
            raise ValueError(f"action has shape {tuple(action.shape)}; expected ({self.num_envs}, 2)")
        if torch.isnan(action).any():
            raise ValueError("action contains NaN; actions must be finite in [-1, 1]")
        a = action.clamp(-1.0, 1.0).cpu().numpy()
        for i, c in enumerate(self.conns):
            try:
                c.send(("step", a[i]))
            except (BrokenPipeError, ConnectionResetError):  # a dead worker: its recv below fails and replaces it
                pass
        obs, rew, term, trunc, infos = [], [], [], [], []
        for i in range(self.num_envs):
            try:
                o, r, te, tr, info = self._recv(i)[1]
                lost = False
            except (EOFError, ConnectionResetError, BrokenPipeError):
                o, lost = self._replace(i), True
                r, te, tr = np.zeros(1, np.float32), np.zeros(1, bool), np.ones(1, bool)
                info = None
            obs.append(o)
            rew.append(r)
            term.append(te)
            trunc.append(tr)
            infos.append((info, lost))
        for inf, _ in infos:
            if inf is not None and self._info_template is None:
                self._info_template = {k: np.zeros_like(v) for k, v in inf.items()}
        template = self._info_template or {"done": np.zeros(1, bool), "carla/crash": np.zeros(1, np.float32),
                                           "carla/restarts": np.zeros(1, np.float32)}
        # a replaced worker's row has no episode statistics: zeros, done, counted as a crash and a restart
        rows = [inf if inf is not None else template for inf, _ in infos]
        merged = {k: torch.as_tensor(np.concatenate([r[k] for r in rows])).to(self.device) for k in template}
        lost_rows = torch.tensor([lost for _, lost in infos], device=self.device)
        merged["done"] = merged["done"].bool() | lost_rows
        merged["carla/crash"] = torch.maximum(merged["carla/crash"], lost_rows.float())
        merged["carla/restarts"] = merged["carla/restarts"] + torch.as_tensor(self.row_restarts, device=self.device)
        if "episode/carla_restarts" in merged:
            merged["episode/carla_crash"] = merged["carla/crash"].clone()
            merged["episode/carla_restarts"] = merged["carla/restarts"].clone()
        merged["carla/process_restarts"] = torch.full((self.num_envs,), float(self.process_restarts),
                                                      device=self.device)
        return StepResult(self._stack(obs), torch.as_tensor(np.concatenate(rew)).to(self.device),
                          torch.as_tensor(np.concatenate(term)).to(self.device),
                          torch.as_tensor(np.concatenate(trunc)).to(self.device), merged)

    def _server_groups(self, i: int) -> list[int]:
        """Process groups of row i's server: the first one the worker reported and the current one from its pid file
        (``log_dir/carla_<rpc port>.pid``, rewritten when the worker restarts its server)."""
        pids = [self.server_pids[i]]
        pid_file = Path(self.ccfg.log_dir) / f"carla_{self.blocks[i].rpc}.pid"
        try:
            if self.ccfg.launch and pid_file.stat().st_mtime >= self._started - 1.0:  # not one of an earlier run
                pids.append(read_pid_file(pid_file))
        except OSError:
            pass
        return list(dict.fromkeys(p for p in pids if p))

    def close(self) -> None:
        """Ask every worker to close (it destroys its actors and stops its server), wait, then make sure: kill
        workers that did not exit and stop every server process group of this env."""
        if self._closed:
            return
        self._closed = True
        untrack(self)
        for c in self.conns:
            if c is not None:
                try:
                    c.send(("close", None))
                except (OSError, BrokenPipeError):
                    pass
        deadline = time.monotonic() + 15.0
        for p in self.procs:
            if p is not None:
                p.join(timeout=max(deadline - time.monotonic(), 0.1))
        self._stop_processes(grace=2.0)
        for c in self.conns:
            if c is not None:
                c.close()

    def _stop_processes(self, grace: float) -> None:
        """Workers: SIGTERM (a worker then stops its server), SIGKILL after ``grace``; then every server group."""
        procs = [p for p in self.procs if p is not None and p.is_alive()]
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + grace + 1.0
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.05))
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        for i in range(self.num_envs):
            for pgid in self._server_groups(i):
                kill_group(pgid, grace)

    def _emergency_stop(self) -> None:
        """The main process got SIGTERM: stop workers and servers now (no per-worker clean-up of actors)."""
        self._closed = True
        untrack(self)
        self._stop_processes(grace=2.0)

    def __enter__(self) -> "CarlaVectorEnv":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def make_carla_env(num_envs: int, device: str | torch.device = "cpu", seed: int = 0, **options: Any
                   ) -> CarlaVectorEnv:
    """``env=carla``: validate ``options`` (CARLA keys of :class:`CarlaConfig` plus :class:`SimConfig` keys) and
    start ``num_envs`` workers, each on its own CARLA server."""
    ccfg, scfg = split_options(options)
    return CarlaVectorEnv(ccfg, scfg, num_envs, device, seed)
