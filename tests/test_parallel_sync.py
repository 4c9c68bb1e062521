"""The gradient-sync layer with 2 gloo ranks on CPU (each test spawns its own processes, with timeouts).

Workers run in fresh interpreters (``python -c "from tests.test_parallel_sync import ..."``) with torchrun's
environment variables, and write their results as JSON next to the test's ``tmp_path``.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from carl.checkpoint import plain_data
from carl.config import ParallelConfig
from carl.parallel.accounting import SyncStats
from carl.parallel.lgreco import LGreCoReducer, candidate_ranks, plan_ranks, rank_errors
from carl.parallel.lowrank import LowRankReducer
from carl.parallel.topk import TopKReducer

REPO = Path(__file__).resolve().parent.parent
METHODS = ("allreduce", "fp16", "bf16", "powersgd", "lgreco", "topk", "localsgd")


# ------------------------------------------------------------------------------------------------------------------
# launching helpers
# ------------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(call: str, out_dir: Path, world: int = 2, timeout: float = 120, extra_env: dict | None = None) -> list[dict]:
    """Run ``tests.test_parallel_sync.<call>(out_dir)`` on ``world`` ranks; return each rank's JSON result."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", **(extra_env or {})}
        code = f"from tests.test_parallel_sync import {call}; {call}({str(out_dir)!r})"
        log = out_dir / f"rank{rank}.log"
        logs.append(log)
        with open(log, "w") as fh:
            procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=fh,
                                          stderr=subprocess.STDOUT))
    deadline = time.time() + timeout
    try:  # until every rank exited or wrote its result (a deliberately hung rank is killed below)
        while time.time() < deadline:
            if all(p.poll() is not None for p in procs):
                break
            if all((out_dir / f"rank{r}.json").is_file() for r in range(world)):
                time.sleep(0.5)
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outputs = [log.read_text() for log in logs]
    results = []
    for rank in range(world):
        path = out_dir / f"rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no result; output:\n" + "\n".join(outputs)
        results.append(json.loads(path.read_text()))
    return results


def _init() -> tuple:
    from carl.parallel import init_distributed

    torch.set_num_threads(1)
    return init_distributed("cpu", "gloo", timeout_s=60)


def _tiny_policy(seed: int = 0):
    from carl.policy import CarlPolicy
    from tests.fake_env import FakeDrivingEnv

    env = FakeDrivingEnv(num_envs=2, bev_size=24, bev_channels=3, episode_length=8)
    torch.manual_seed(seed)
    return CarlPolicy(env.observation_spec, 2), env


def _obs(env, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {k: (torch.randint(0, 255, (n, *s.shape), generator=gen).to(torch.uint8) if s.dtype == torch.uint8
                else torch.randn(n, *s.shape, generator=gen)) for k, s in env.observation_spec.items()}


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _par(**kw) -> ParallelConfig:
    base = dict(powersgd_rank=2, lgreco_every=3, lgreco_acc_steps=2, topk_ratio=0.05, local_steps=2,
                outer_momentum=0.5, staleness_penalty=2.0, outer_clip=10.0)
    return ParallelConfig(**{**base, **kw})


# ------------------------------------------------------------------------------------------------------------------
# workers (run inside the spawned ranks)
# ------------------------------------------------------------------------------------------------------------------
def _train_and_gather(sync, policy, env, rank: int, steps: int = 7) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """Adam steps on this rank's own random data through ``sync``; then (own params, every rank's, sync stats)."""
    import torch.distributed as dist

    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        out = sync.act(_obs(env, 4, gen), torch.rand(4, 2, generator=gen) * 1.8 - 0.9)
        opt.zero_grad(set_to_none=True)
        (-out.log_prob.mean() + out.value.pow(2).mean()).backward()
        opt.step()
        sync.after_step()
    sync.flush()
    flat = _flat(policy)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return flat, gathered, sync.pop_stats()


def worker_methods(out_dir: str) -> None:
    """Every method: several Adam steps on per-rank data, then the replicas' parameters must be identical."""

    from carl.parallel import make_sync

    ctx, _ = _init()
    result: dict = {}
    for method in METHODS:
        policy, env = _tiny_policy()
        sync = make_sync(policy, ctx, _par(sync=method))
        flat, gathered, stats = _train_and_gather(sync, policy, env, ctx.rank)
        result[method] = {"max_diff": float((gathered[0] - gathered[1]).abs().max()),
                          "ratio": stats.get("sync/compression_ratio", 0.0),
                          "moved": float((flat - _flat(_tiny_policy()[0])).abs().max())}
        if method == "lgreco":
            result[method]["replans"] = sync.reducer.replans
    try:  # refusal: torch's PowerSGD hook with several buckets on gloo
        make_sync(_tiny_policy()[0], ctx, _par(sync="powersgd", powersgd_impl="torch", bucket_cap_mb=0.5))
        result["refusal"] = ""
    except ValueError as exc:
        result["refusal"] = str(exc)
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(result))
    ctx.shutdown()


def _ppo_batch(env, n: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"obs": _obs(env, n, gen), "actions": torch.rand(n, 2, generator=gen) * 1.8 - 0.9,
            "log_probs": torch.randn(n, generator=gen) * 0.1 - 1.0, "values": torch.randn(n, generator=gen),
            "returns": torch.randn(n, generator=gen), "advantages": torch.randn(n, generator=gen) * 2 + 0.5,
            "alpha": torch.rand(n, 2, generator=gen) + 1.0, "beta": torch.rand(n, 2, generator=gen) + 1.0}


def worker_equivalence(out_dir: str) -> None:
    """PPO updates: 2 ranks with B samples each == 1 process with the 2B samples (allreduce); and error feedback."""
    import torch.distributed as dist

    from carl.config import PPOConfig
    from carl.parallel import make_sync
    from carl.parallel.accounting import SyncStats
    from carl.parallel.lowrank import LowRankReducer
    from carl.parallel.topk import TopKReducer
    from carl.ppo import PPOTrainer

    ctx, _ = _init()
    half = 6
    cfg = PPOConfig(num_steps=half // 2, minibatch_size=2 * half, update_epochs=1, accumulation_steps=2)
    policy, env = _tiny_policy(seed=3)
    ref_policy, _ = _tiny_policy(seed=3)
    trainer = PPOTrainer(policy, env, cfg, sync=make_sync(policy, ctx, _par()), ctx=ctx)
    ref = PPOTrainer(ref_policy, env, cfg)  # one process, the whole batch
    for step in range(3):
        full = _ppo_batch(env, 2 * half, seed=step)
        mine = {k: ({kk: vv[ctx.rank * half:(ctx.rank + 1) * half] for kk, vv in v.items()} if k == "obs"
                    else v[ctx.rank * half:(ctx.rank + 1) * half]) for k, v in full.items()}
        trainer._optimise(mine)
        ref._optimise(full)
    result = {"equiv_diff": float((_flat(policy) - _flat(ref_policy)).abs().max()),
              "equiv_scale": float(_flat(ref_policy).abs().max())}

    # error feedback: sum_t applied_t + mean_r residual_T == sum_t mean_r grad_t
    for name, reducer in (("topk", TopKReducer(SyncStats(), 0.05, start_step=0)),
                          ("lowrank", LowRankReducer(SyncStats(), rank=1, start_step=0))):
        gen = torch.Generator().manual_seed(7 + ctx.rank)
        applied = torch.zeros(40, 30)
        grad_sum = torch.zeros(40, 30)
        for _ in range(6):
            g = torch.randn(40, 30, generator=gen)
            mean_g = g.clone()
            dist.all_reduce(mean_g)
            grad_sum += mean_g / ctx.world_size
            work = g.clone()
            reducer.reduce([("w", work)])
            reducer.end_step()
            applied += work
        residual = reducer.error["w"].reshape(40, 30).clone()
        dist.all_reduce(residual)
        result[f"ef_{name}"] = float((applied + residual / ctx.world_size - grad_sum).abs().max())
        result[f"ef_{name}_without_residual"] = float((applied - grad_sum).abs().max())
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(result))
    ctx.shutdown()


class _OneTensorBucket:
    """The part of DDP's ``GradBucket`` a comm hook reads, for one parameter whose gradient is ``grad``."""

    def __init__(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        self.param, self.grad = param, grad

    def buffer(self) -> torch.Tensor:
        return self.grad.view(-1)

    def gradients(self) -> list[torch.Tensor]:
        return [self.grad]

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.param]

    def is_last(self) -> bool:
        return True


def worker_hierarchical(out_dir: str) -> None:
    """4 ranks as 2 nodes x 2: replicas identical, bytes split by link, error feedback conserved across nodes."""
    import torch.distributed as dist

    from carl.parallel import make_sync
    from carl.parallel.hierarchy import node_groups
    from carl.parallel.layerwise import layerwise_hook

    ctx, _ = _init()
    result: dict = {}
    for method in ("powersgd", "lgreco", "topk"):
        policy, env = _tiny_policy()
        sync = make_sync(policy, ctx, _par(sync=method, hierarchical=True, node_size=2))
        flat, gathered, stats = _train_and_gather(sync, policy, env, ctx.rank)
        result[method] = {"max_diff": max(float((g - gathered[0]).abs().max()) for g in gathered),
                          "ratio": stats.get("sync/compression_ratio"), "inter": stats.get("sync/bytes_per_update"),
                          "intra": stats["sync/intra_node_bytes_per_update"],
                          "fp32": 4.0 * flat.numel() * stats["sync/steps"]}

    # error feedback across nodes through the hook itself:
    # sum_t applied_t + mean_nodes(leader residual_T) == sum_t mean_ranks(grad_t)
    nodes = node_groups(ctx, 2)
    leads = nodes.leaders is not None
    result["groups"] = [dist.get_process_group_ranks(nodes.intra), nodes.leader, leads and
                        dist.get_process_group_ranks(nodes.leaders)]
    reducer = TopKReducer(SyncStats(), 0.05, start_step=0)
    reducer.group = nodes.leaders
    weight = torch.nn.Parameter(torch.zeros(40, 30))
    hook = layerwise_hook(reducer, {weight: "w"}, SyncStats(), nodes)
    gen = torch.Generator().manual_seed(7 + ctx.rank)
    applied, grad_sum = torch.zeros(40, 30), torch.zeros(40, 30)
    for _ in range(6):
        g = torch.randn(40, 30, generator=gen)
        mean_g = g.clone()
        dist.all_reduce(mean_g)
        grad_sum += mean_g / ctx.world_size
        hook(None, _OneTensorBucket(weight, g))
        applied += g
    residual = reducer.error["w"].reshape(40, 30).clone() if leads else torch.zeros(40, 30)
    dist.all_reduce(residual)  # the leaders' residuals, summed over the 2 nodes
    result["ef"] = float((applied + residual / nodes.nodes - grad_sum).abs().max())
    result["ef_without_residual"] = float((applied - grad_sum).abs().max())
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(result))
    ctx.shutdown()


def worker_peer_failure(out_dir: str) -> None:
    """Rank 1 dies (or hangs) before a collective; rank 0 must get a DistributedError naming it, in bounded time."""
    from carl.parallel import DistContext, DistributedError, init_distributed

    mode = os.environ["CARL_TEST_FAILURE"]
    ctx, _ = init_distributed("cpu", "gloo", timeout_s=3)
    assert isinstance(ctx, DistContext)
    ctx.all_reduce_sum(torch.ones(1), "warm-up")
    if ctx.rank == 1:
        Path(out_dir, "rank1.json").write_text(json.dumps({"role": mode}))
        if mode == "dies":
            os._exit(1)
        time.sleep(60)
        os._exit(0)
    start = time.perf_counter()
    try:
        ctx.all_reduce_sum(torch.ones(1000), "gradient all-reduce")
        result = {"error": "", "seconds": time.perf_counter() - start}
    except DistributedError as exc:
        result = {"error": str(exc), "seconds": time.perf_counter() - start}
    Path(out_dir, "rank0.json").write_text(json.dumps(result))
    os._exit(0)


# ------------------------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------------------------
def test_every_method_keeps_replicas_identical(tmp_path: Path) -> None:
    results = spawn("worker_methods", tmp_path, timeout=240)
    for method in METHODS:
        r = results[0][method]
        assert r["max_diff"] == 0.0, (method, r)
        assert r["moved"] > 0.0, (method, r)  # training happened
    assert results[0]["lgreco"]["replans"] >= 1
    for method in ("powersgd", "lgreco", "topk"):
        assert results[0][method]["ratio"] > 2.0, (method, results[0][method])
    assert 1.9 < results[0]["fp16"]["ratio"] < 2.1 and 1.9 < results[0]["bf16"]["ratio"] < 2.1
    assert "gloo" in results[0]["refusal"] and "bucket" in results[0]["refusal"]


def test_allreduce_two_ranks_match_one_rank_and_error_feedback(tmp_path: Path) -> None:
    results = spawn("worker_equivalence", tmp_path, timeout=180)
    for r in results:
        assert r["equiv_diff"] <= 1e-5 * max(1.0, r["equiv_scale"]), r
        for name in ("topk", "lowrank"):
            assert r[f"ef_{name}"] < 1e-4, (name, r)
            assert r[f"ef_{name}_without_residual"] > 1e-2, (name, r)  # compression did lose something per step


def test_hierarchical_sync_on_two_nodes_of_two_ranks(tmp_path: Path) -> None:
    results = spawn("worker_hierarchical", tmp_path, world=4, timeout=300)
    for rank, r in enumerate(results):
        for method in ("powersgd", "lgreco", "topk"):
            m = r[method]
            assert m["max_diff"] == 0.0, (method, m)
            assert m["intra"] == 2 * m["fp32"], (method, m)  # exact all-reduce + the leader's broadcast, fp32
            if rank % 2 == 0:  # node leaders: the only traffic between nodes, compressed
                assert m["inter"] < m["fp32"] / 2 and m["ratio"] > 2.0, (method, m)
            else:
                assert m["inter"] is None and m["ratio"] is None, (method, m)
        assert r["ef"] < 1e-4 and r["ef_without_residual"] > 1e-2, r
    # torchrun numbers ranks node by node: nodes {0, 1} and {2, 3}, led by ranks 0 and 2
    assert [r["groups"] for r in results] == [[[0, 1], 0, [0, 2]], [[0, 1], 0, False], [[2, 3], 2, [0, 2]],
                                              [[2, 3], 2, False]]


@pytest.mark.parametrize("mode", ["dies", "hangs"])
def test_dead_or_hanging_rank_gives_clear_error(tmp_path: Path, mode: str) -> None:
    start = time.time()
    results = spawn("worker_peer_failure", tmp_path, timeout=60, extra_env={"CARL_TEST_FAILURE": mode})
    r0 = results[0]
    assert "rank 0/2" in r0["error"] and "gradient all-reduce" in r0["error"], r0
    assert "died or hung" in r0["error"]
    assert r0["seconds"] < 20 and time.time() - start < 60


@pytest.mark.parametrize("kind", ["powersgd", "lgreco", "topk"])
def test_error_feedback_state_survives_a_checkpoint(kind: str) -> None:
    """Shared + per-rank state restored into a new reducer gives bit-identical output; shared state alone does not."""
    make = {"powersgd": lambda: LowRankReducer(SyncStats(), rank=1, start_step=0),
            "lgreco": lambda: LGreCoReducer(SyncStats(), rank=2, every=2, acc_steps=1, start_step=0),
            "topk": lambda: TopKReducer(SyncStats(), 0.05, start_step=0)}[kind]
    gen = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (24, 16), "conv.weight": (8, 4, 3, 3)}  # both above topk's 256-entry minimum

    def step(reducer, grads: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        grads = [(n, g.clone()) for n, g in grads]
        reducer.reduce(grads)
        reducer.end_step()
        return [g for _, g in grads]

    def new_grads() -> list[tuple[str, torch.Tensor]]:
        return [(n, torch.randn(*shape, generator=gen)) for n, shape in shapes.items()]

    original = make()
    for _ in range(5):
        step(original, new_grads())
    shared, own = original.state_dict(), original.rank_state_dict()
    assert own["error"].keys() == shapes.keys()
    plain_data(shared)  # what last.pt can hold: a weights_only load reads it back
    plain_data(own)
    restored, forgetful = make(), make()
    restored.load_state_dict(shared)
    restored.load_rank_state_dict(own)
    forgetful.load_state_dict(shared)  # residuals lost, as before checkpoints carried them
    grads = new_grads()
    expected = step(original, grads)
    assert all(torch.equal(a, b) for a, b in zip(expected, step(restored, grads)))
    assert not all(torch.allclose(a, b) for a, b in zip(expected, step(forgetful, grads)))


def test_node_size_must_divide_the_world() -> None:
    from carl.parallel import DistContext
    from carl.parallel.hierarchy import node_groups

    with pytest.raises(ValueError, match=r"parallel.node_size=3 must divide the world size 8"):
        node_groups(DistContext(rank=0, world_size=8), 3)


def test_lgreco_planner_finds_the_known_optimum() -> None:
    # hand-made case: the unique optimum is candidate 0 for layer 0 and candidate 2 for layer 1 (size 5, error 5)
    errors = [[4.0, 1.0, 0.0], [4.0, 2.0, 1.0]]
    sizes = [[1, 5, 9], [2, 3, 4]]
    assert plan_ranks(errors, sizes, budget=5.0) == [0, 2]

    # random instances with integer errors (on the discretisation grid): the DP equals exhaustive search
    import itertools

    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        layers = 4
        errs = [sorted(torch.randint(0, 50, (3,), generator=gen).tolist(), reverse=True) for _ in range(layers)]
        szs = [sorted(torch.randint(1, 100, (3,), generator=gen).tolist()) for _ in range(layers)]
        budget = float(sum(e[1] for e in errs))
        best = min((sum(szs[l][j] for l, j in enumerate(c)), c) for c in itertools.product(range(3), repeat=layers)
                   if sum(errs[l][j] for l, j in enumerate(c)) <= budget + 1e-9)
        picks = plan_ranks(errs, szs, budget, bins=int(budget))  # integer errors, width 1
        assert sum(szs[l][j] for l, j in enumerate(picks)) == best[0]
        assert sum(errs[l][j] for l, j in enumerate(picks)) <= budget + 1e-9

    # synthetic gradients: a rank-1 layer and a full-rank layer. Exhaustive search over the candidate ranks gives
    # the optimum; the planner must find it (and give the rank-1 layer the smallest rank)
    low = torch.outer(torch.randn(64, generator=gen), torch.randn(48, generator=gen))
    full = torch.randn(64, 48, generator=gen) * torch.linspace(3, 0.1, 48)
    reducer = LGreCoReducer(SyncStats_(), rank=4)
    plan = reducer.make_plan({"low": low, "full": full})
    cands = {k: candidate_ranks(4, 64, 48) for k in ("low", "full")}
    errs = {k: rank_errors(m, cands[k]) for k, m in (("low", low), ("full", full))}
    budget = rank_errors(low, [4])[0] + rank_errors(full, [4])[0]
    best = min((112 * (a + b), (a, b)) for (i, a), (j, b) in itertools.product(enumerate(cands["low"]),
                                                                               enumerate(cands["full"]))
               if errs["low"][i] + errs["full"][j] <= budget)
    assert (plan["low"], plan["full"]) == best[1]
    assert plan["low"] == min(cands["low"])
    planned, uniform = reducer.last_plan_bytes
    assert planned <= uniform


def SyncStats_():  # noqa: N802 - small factory for the planner test
    from carl.parallel.accounting import SyncStats

    return SyncStats()
