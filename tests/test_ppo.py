"""PPO: GAE by hand, gradient-accumulation equivalence, truncation bootstrap, and a learning test."""
from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from carl.config import PPOConfig
from carl.parallel import DistContext
from carl.policy import CarlPolicy
from carl.ppo import PPOTrainer, compute_gae
from carl.ppo.loss import bc_loss, ppo_loss
from carl.progress import RunProgress
from tests.fake_env import make_fake_env


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The test machine has 2 shared cores; one thread is faster than oversubscribing them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_gae_by_hand() -> None:
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.5], [0.4], [0.3]])
    dones = torch.tensor([[0.0], [1.0], [0.0]])  # the episode ends after step 1
    next_value = torch.tensor([0.2])
    g, lam = 0.9, 0.8
    adv, ret = compute_gae(rewards, values, dones, next_value, g, lam)
    a2 = 3 + g * 0.2 - 0.3
    a1 = 2 - 0.4  # no bootstrap through the end
    a0 = (1 + g * 0.4 - 0.5) + g * lam * a1
    assert torch.allclose(adv[:, 0], torch.tensor([a0, a1, a2]))
    assert torch.allclose(ret, adv + values)

    # truncation with bootstrap: V(final obs) = 0.7 enters the TD target, the chain is still cut
    boot = torch.tensor([[0.0], [0.7], [0.0]])
    adv_b, _ = compute_gae(rewards, values, dones, next_value, g, lam, boot)
    b1 = 2 + g * 0.7 - 0.4
    assert torch.allclose(adv_b[:, 0], torch.tensor([(1 + g * 0.4 - 0.5) + g * lam * b1, b1, a2]))


def test_gae_batched_rows_independent() -> None:
    torch.manual_seed(0)
    r, v, d = torch.randn(5, 3), torch.randn(5, 3), (torch.rand(5, 3) > 0.7).float()
    nv = torch.randn(3)
    adv, _ = compute_gae(r, v, d, nv, 0.99, 0.95)
    for b in range(3):
        adv_b, _ = compute_gae(r[:, b : b + 1], v[:, b : b + 1], d[:, b : b + 1], nv[b : b + 1], 0.99, 0.95)
        assert torch.allclose(adv[:, b], adv_b[:, 0])


def _trainer(**ppo: object) -> PPOTrainer:
    env = make_fake_env(4, "cpu", seed=0, bev_size=24, bev_channels=3, episode_length=8, keep_final_obs=True)
    policy = CarlPolicy(env.observation_spec)
    cfg = PPOConfig(**{"num_steps": 8, "minibatch_size": 16, "update_epochs": 2, **ppo})  # type: ignore[arg-type]
    trainer = PPOTrainer(policy, env, cfg)
    trainer.reset(seed=0)
    return trainer


def test_accumulation_equivalence() -> None:
    torch.manual_seed(0)
    trainer = _trainer()
    trainer.collect()
    start_model = copy.deepcopy(trainer.policy.state_dict())
    start_opt = copy.deepcopy(trainer.optimizer.state_dict())
    results = []
    for k in (1, 4):
        trainer.policy.load_state_dict(start_model)
        trainer.optimizer.load_state_dict(start_opt)
        trainer.cfg.accumulation_steps = k
        torch.manual_seed(123)  # same minibatch permutation
        metrics = trainer.update()
        results.append(([p.detach().clone() for p in trainer.policy.parameters()], metrics))
    (p1, m1), (p4, m4) = results
    for a, b in zip(p1, p4):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    for key in ("losses/policy_loss", "losses/value_loss", "losses/approx_kl"):
        assert abs(m1[key] - m4[key]) < 1e-4, key


def test_bootstrap_truncation_uses_final_obs() -> None:
    torch.manual_seed(0)
    trainer = _trainer(bootstrap_truncation=True)
    trainer.collect()  # episode_length == num_steps: every row truncates at the last step
    st = trainer.storage
    assert (st.bootstrap[-1] != 0).all() and (st.bootstrap[:-1] == 0).all()
    assert (st.dones[-1] == 1).all()
    default = _trainer()
    default.collect()
    assert (default.storage.bootstrap == 0).all()


def test_ppo_learns_on_fake_env() -> None:
    """Mean return must rise clearly within 14 updates (random ~3, optimum 16); ~10 s on one core."""
    torch.manual_seed(0)
    env = make_fake_env(8, "cpu", seed=0, bev_size=24, bev_channels=3, episode_length=16)
    policy = CarlPolicy(env.observation_spec)
    cfg = PPOConfig(num_steps=32, minibatch_size=128, update_epochs=4, learning_rate=3e-3, ent_coef=0.0, clip_coef=0.2)
    trainer = PPOTrainer(policy, env, cfg)
    trainer.reset(seed=0)
    returns = []
    for update in range(1, 15):
        trainer.set_schedule((update - 1) / 14)
        trainer.collect()
        trainer.update()
        returns.append(trainer.episodes.summary()["episode/return"])
        trainer.episodes.clear()
    first, last = sum(returns[:3]) / 3, sum(returns[-3:]) / 3
    assert last > first + 2.0, returns


def test_a_teacher_pulls_the_mean_action_to_its_own_and_fades_out() -> None:
    """``ppo.teacher``: the squared error of the Beta mean to the teacher's action (here a constant (0.6, -0.4)) is
    added with ``bc_coef``, decaying linearly to 0 at ``bc_until`` of the run: with 10 updates and bc_until 0.5 the
    weight is 4.0 at update 1, 4.0 * (1 - 2/5) = 2.4 at update 3 and 0 from update 6, where the teacher is no longer
    asked."""
    torch.manual_seed(0)
    env = make_fake_env(8, "cpu", seed=0, bev_size=24, bev_channels=3, episode_length=16)
    policy = CarlPolicy(env.observation_spec)
    target = torch.tensor([0.6, -0.4])
    calls = []

    def teacher(obs: dict[str, torch.Tensor]) -> torch.Tensor:
        calls.append(1)
        return target.expand(next(iter(obs.values())).shape[0], 2)

    cfg = PPOConfig(num_steps=16, minibatch_size=64, update_epochs=4, learning_rate=3e-3, ent_coef=0.0,
                    bc_coef=4.0, bc_until=0.5)
    trainer = PPOTrainer(policy, env, cfg, teacher=teacher)
    trainer.reset(seed=0)
    obs = env.reset(seed=1)
    before = (policy.deterministic_action(obs) - target).abs().max().item()
    weights, bc = [], []
    for update in range(1, 11):
        trainer.set_schedule((update - 1) / 10)
        weights.append(trainer.bc_weight)
        trainer.collect()
        bc.append(trainer.update()["losses/bc_loss"])
        if update == 5:
            after = (policy.deterministic_action(obs) - target).abs().max().item()
    assert weights[:3] == pytest.approx([4.0, 3.2, 2.4]) and weights[5:] == [0.0] * 5
    assert len(calls) == 5 * 16  # asked in each rollout step of updates 1-5 only
    assert before > 0.3 and after < 0.1, (before, after)
    assert bc[0] > bc[4] > 0 and bc[5:] == [0.0] * 5


def test_a_teacher_weight_with_a_floor_decays_to_it_and_stays() -> None:
    """``ppo.bc_final``: the weight decays to bc_coef x bc_final instead of 0. bc_coef 2, bc_until 0.5, bc_final 0.25
    over 10 updates: 2.0 at update 1, 2 * (0.25 + 0.75 * (1 - 2/5)) = 1.4 at update 3, 0.5 from update 6 on."""
    env = make_fake_env(2, "cpu", seed=0, bev_size=24, bev_channels=3, episode_length=16)
    cfg = PPOConfig(num_steps=4, minibatch_size=8, bc_coef=2.0, bc_until=0.5, bc_final=0.25)
    trainer = PPOTrainer(CarlPolicy(env.observation_spec), env, cfg, teacher=lambda obs: torch.zeros(2, 2))
    weights = []
    for update in range(1, 11):
        trainer.set_schedule((update - 1) / 10)
        weights.append(trainer.bc_weight)
    assert weights[:3] == pytest.approx([2.0, 1.7, 1.4]) and weights[5:] == pytest.approx([0.5] * 5)


def test_a_time_budget_drives_the_schedule_where_it_is_further_along_than_the_updates() -> None:
    """``ppo.train_for_seconds``: 10 updates, a 100 s budget, the clock read after each update. Before update 1 at
    0 s the progress is 0; at 30 s before update 2 it is max(1/10, 30/100) = 0.3; at 35 s before update 6 it is
    max(5/10, 0.35) = 0.5; at 100 s the budget is spent. lr0 2e-3 gives 2e-3, 1.4e-3 and 1e-3; bc_coef 2 with
    bc_until 0.5, bc_final 0.25: 2 * (0.25 + 0.75 * (1 - 0.3 / 0.5)) = 1.1 at 0.3, and the floor 0.5 from 0.5 on."""
    readings = iter([0.0, 30.0, 35.0, 100.0])
    progress = RunProgress(10, 100.0, lambda: next(readings), DistContext())
    env = make_fake_env(2, "cpu", seed=0, bev_size=24, bev_channels=3, episode_length=16)
    cfg = PPOConfig(num_steps=4, minibatch_size=8, learning_rate=2e-3, bc_coef=2.0, bc_until=0.5, bc_final=0.25)
    trainer = PPOTrainer(CarlPolicy(env.observation_spec), env, cfg, teacher=lambda obs: torch.zeros(2, 2))
    seen = []
    for update in (1, 2, 6):
        seen.append((progress.fraction(update), trainer.set_schedule(progress.fraction(update)), trainer.bc_weight))
        assert not progress.spent()
        progress.tick()
    assert seen == [pytest.approx(x) for x in [(0.0, 2e-3, 2.0), (0.3, 1.4e-3, 1.1), (0.5, 1e-3, 0.5)]]
    assert progress.spent() and progress.fraction(7) == 1.0
    plain = RunProgress(10, 0.0, lambda: 1e9, DistContext())  # no budget: updates alone, never spent
    assert plain.fraction(6) == 0.5 and not plain.spent() and plain.describe() == ""


def test_a_teacher_asked_every_nth_step_labels_those_steps_only() -> None:
    """``ppo.teacher_every=4`` over 16-step rollouts: the teacher is asked at steps 0, 4, 8, 12 (4 calls per
    rollout), and the cloning term averages over those samples alone. Beta(1, 1) has mean 0.5, the action 0 on
    [-1, 1]: against teacher actions (1, 0) and (0.5, 0) the squared errors are 1 and 0.25, so with only the first
    labelled the term is 1.0, with both 0.625, with none 0."""
    ones = torch.ones(2, 2)
    actions = torch.tensor([[1.0, 0.0], [0.5, 0.0]])
    assert bc_loss(ones, ones, actions, torch.tensor([1.0, 0.0])).item() == pytest.approx(1.0)
    assert bc_loss(ones, ones, actions, torch.tensor([1.0, 1.0])).item() == pytest.approx(0.625)
    assert bc_loss(ones, ones, actions).item() == pytest.approx(0.625)
    assert bc_loss(ones, ones, actions, torch.tensor([0.0, 0.0])).item() == 0.0

    env = make_fake_env(8, "cpu", seed=0, bev_size=24, bev_channels=3, episode_length=16)
    calls = []

    def teacher(obs: dict[str, torch.Tensor]) -> torch.Tensor:
        calls.append(1)
        return torch.zeros(next(iter(obs.values())).shape[0], 2)

    cfg = PPOConfig(num_steps=16, minibatch_size=64, update_epochs=1, bc_coef=1.0, bc_until=1.0, teacher_every=4)
    trainer = PPOTrainer(CarlPolicy(env.observation_spec), env, cfg, teacher=teacher)
    trainer.reset(seed=0)
    trainer.set_schedule(0.0)
    trainer.collect()
    assert len(calls) == 4
    assert trainer.storage.labelled[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0] * 4
    assert trainer.update()["losses/bc_loss"] > 0


def test_pg_coef_weights_the_surrogate_alone() -> None:
    """With ratio 1 (new = old log-probs) the surrogate is -mean(advantages) = -mean(1, -3) = 1.0; the value loss
    (no clip) 0.5 * mean(1^2, 2^2) = 1.25, weighted 0.5; the entropy 0.5, weighted 0.1. So the loss is 1.0 - 0.05 +
    0.625 = 1.575 with pg_coef 1 and 0.575 with pg_coef 0 (``ppo.pg_coef=0``: DAgger with a teacher), where the
    log-probabilities get no gradient at all."""
    log_prob = torch.zeros(2, requires_grad=True)
    args = (log_prob, torch.zeros(2), torch.tensor([1.0, -3.0]), torch.tensor([1.0, 2.0]), torch.zeros(2),
            torch.zeros(2), torch.full((2,), 0.5), 0.1, False, 0.5, 0.1)
    assert ppo_loss(*args).loss.item() == pytest.approx(1.575)
    assert ppo_loss(*args, pg_coef=0.5).loss.item() == pytest.approx(1.075)
    off = ppo_loss(*args, pg_coef=0.0)
    assert off.loss.item() == pytest.approx(0.575) and off.policy_loss.item() == pytest.approx(1.0)
    off.loss.backward()
    assert log_prob.grad.abs().max().item() == 0.0
