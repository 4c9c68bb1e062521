"""CaRL network: parameter count, shapes at several BEV sizes, Beta distribution maths."""
from __future__ import annotations

import pytest
import torch

from carl.policy import (
    CarlPolicy,
    beta_entropy,
    beta_kl,
    beta_log_prob,
    beta_mean_action,
    plan_conv_stack,
)
from envs.api import TensorSpec


def spec(c: int, s: int, m: int = 8, v: int = 10) -> dict[str, TensorSpec]:
    return {
        "bev": TensorSpec((c, s, s), torch.uint8),
        "measurements": TensorSpec((m,), torch.float32),
        "value_measurements": TensorSpec((v,), torch.float32),
    }


def obs(c: int, s: int, b: int = 3, m: int = 8, v: int = 10) -> dict[str, torch.Tensor]:
    return {
        "bev": torch.randint(0, 256, (b, c, s, s), dtype=torch.uint8),
        "measurements": torch.randn(b, m),
        "value_measurements": torch.randn(b, v),
    }


def test_a_float64_network_casts_its_inputs_to_float64_and_answers_in_float32() -> None:
    """``carl-eval precision=float64`` runs the network in float64: the uint8 BEV and float32 measurements are cast to
    the parameters' dtype (a float32 cast would fail against float64 weights), and alpha, beta and the value come back
    in float32, as the env and the losses read them; the same function as in float32, to float32's precision."""
    torch.manual_seed(0)
    policy = CarlPolicy(spec(4, 64)).eval()
    o = obs(4, 64)
    with torch.no_grad():
        want = policy(o)
        got = policy.double()(o)
    assert policy.dtype == torch.float64 and all(x.dtype == torch.float32 for x in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_carl_param_count_at_256() -> None:
    policy = CarlPolicy(spec(10, 256))
    n = policy.num_params()
    assert abs(n - 1.98e6) / 1.98e6 < 0.02, n
    # CaRL's table exactly: strides 2,2,2,2,2,1,1 and a 256x2x2 output
    assert [l.stride for l in policy.conv_plan] == [2, 2, 2, 2, 2, 1, 1]
    assert [l.out_size[0] for l in policy.conv_plan] == [126, 61, 29, 13, 6, 4, 2]


@pytest.mark.parametrize("size", [256, 128, 64, 32, 23])
def test_forward_shapes(size: int) -> None:
    policy = CarlPolicy(spec(10, size))
    assert policy.conv_plan[-1].out_size[0] >= 1
    alpha, beta, value = policy(obs(10, size, b=2))
    assert alpha.shape == beta.shape == (2, 2) and value.shape == (2,)
    assert (alpha >= 1).all() and (beta >= 1).all()


def test_nuplan_shapes() -> None:
    policy = CarlPolicy(spec(9, 64, m=10, v=4))
    out = policy.act(obs(9, 64, b=4, m=10, v=4))
    assert out.action.shape == (4, 2) and out.log_prob.shape == (4,) and out.value.shape == (4,)
    assert out.action.min() >= -1 and out.action.max() <= 1


def test_too_small_bev_is_refused() -> None:
    with pytest.raises(ValueError, match="too small"):
        plan_conv_stack(10, 16, 16)


def test_beta_maths_matches_torch() -> None:
    torch.manual_seed(0)
    a, b = torch.rand(64, 2) * 5 + 1, torch.rand(64, 2) * 5 + 1
    a2, b2 = torch.rand(64, 2) * 5 + 1, torch.rand(64, 2) * 5 + 1
    action = torch.rand(64, 2) * 2 - 1
    ref = torch.distributions.Beta(a, b)
    assert torch.allclose(beta_log_prob(a, b, action), ref.log_prob((action + 1) / 2).sum(-1), atol=1e-4)
    assert torch.allclose(beta_entropy(a, b), ref.entropy().sum(-1), atol=1e-4)
    kl_ref = torch.distributions.kl_divergence(ref, torch.distributions.Beta(a2, b2)).sum(-1)
    assert torch.allclose(beta_kl(a, b, a2, b2), kl_ref, atol=1e-4)
    # boundary actions are clamped, not -inf
    edge = torch.tensor([[-1.0, 1.0]]).expand(64, 2)
    assert torch.isfinite(beta_log_prob(a, b, edge)).all()


def test_deterministic_action_is_beta_mean() -> None:
    torch.manual_seed(0)
    policy = CarlPolicy(spec(10, 32))
    o = obs(10, 32)
    alpha, beta, _ = policy(o)
    expected = 2 * torch.distributions.Beta(alpha, beta).mean - 1
    assert torch.allclose(policy.deterministic_action(o), expected, atol=1e-6)
    assert torch.allclose(policy.act(o, deterministic=True).action, beta_mean_action(alpha, beta))
