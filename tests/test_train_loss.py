"""GRPO advantages and the decoupled PPO objective on small hand-computed cases."""
import math
import sys

import pytest
import torch

from hexrl.train.loss import equal_reward_groups, group_advantages, ppo_terms

LN = math.log


def test_group_advantages_normalise_within_each_group():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 7.0], ["a", "a", "a", "a", "b", "b", "c"], eps=0.0)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    assert adv[:4] == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert adv[4:] == [0.0, 0.0, 0.0]  # all-equal group and a group of one carry no signal
    assert equal_reward_groups([1.0, 0.0, 3.0, 3.0, 7.0], ["a", "a", "b", "b", "c"]) == {"b", "c"}


def test_group_advantages_are_finite_for_extreme_finite_rewards():
    """Rewards near the float limits give the advantages of their ratios (the sums and squares of the
    formula would overflow to inf and NaN); a non-finite reward's group carries no signal."""
    big, tiny = sys.float_info.max, 5e-324
    rewards = [1e308, 1e308, 0.0, 0.0, big, -big, 1.0, 0.0, tiny, 0.0, -1e300, 1e-300, math.nan, 1.0]
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] * 2 + ["d"] * 2 + ["e"] * 2
    adv = group_advantages(rewards, groups)
    assert all(map(math.isfinite, adv))
    # eps (1e-6) is nothing next to rewards this large
    assert adv[:4] == pytest.approx(group_advantages([1.0, 1.0, 0.0, 0.0], ["a"] * 4, eps=0.0))
    assert adv[4:8] == pytest.approx(group_advantages([1.0, -1.0, 0.0, 0.0], ["b"] * 4, eps=0.0))
    assert adv[8:10] == [0.0, 0.0]  # a difference far below eps: no signal, as with eps in plain units
    assert adv[10:12] == pytest.approx(group_advantages([-1.0, 0.0], ["d"] * 2, eps=0.0)) and adv[12:] == [0.0, 0.0]


def test_clip_and_cap_on_hand_made_tokens():
    # token: A, log(ratio) = θ − p, log(w) = p − b
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    theta = torch.tensor([LN(1.5), LN(0.5), LN(0.9), LN(1.1), LN(1.0)], requires_grad=True)
    prox = torch.zeros(5)
    behav = -torch.tensor([LN(2.0), 0.0, 0.0, 0.0, LN(6.0)])  # w = 2, 1, 1, 1, 6 (> cap 5)
    t = ppo_terms(theta, prox, behav, adv, clip_low=0.2, clip_high=0.3, behav_cap=5.0)
    # pg = max(−A·r, −A·clip(r, 0.8, 1.3)):
    #   r=1.5, A=1  -> max(−1.5, −1.3) = −1.3 (clipped);  r=0.5, A=−1 -> max(0.5, 0.8) = 0.8 (clipped)
    #   r=0.9, A=1  -> −0.9;  r=1.1, A=−1 -> 1.1;  last token masked by the cap
    expected = torch.tensor([2.0 * -1.3, 0.8, -0.9, 1.1, 0.0])
    torch.testing.assert_close(t.loss, expected)
    assert t.clipped.tolist() == [True, True, False, False, False]
    assert t.capped.tolist() == [False, False, False, False, True]
    torch.testing.assert_close(t.w, torch.tensor([2.0, 1.0, 1.0, 1.0, 6.0]))
    loss = t.loss.sum() / 5  # normalised by the ORIGINAL token count, masked token included
    loss.backward()
    # d/dθ of w·(−A·r) = −w·A·r on unclipped tokens, 0 on clipped or capped ones
    torch.testing.assert_close(theta.grad, torch.tensor([0.0, 0.0, -0.9, 1.1, 0.0]) / 5)


def test_reduces_to_textbook_ppo_when_behaviour_is_proximal():
    g = torch.Generator().manual_seed(0)
    theta, old = torch.randn(50, generator=g) * 0.3, torch.randn(50, generator=g) * 0.3
    adv = torch.randn(50, generator=g)
    eps = 0.2
    ratio = torch.exp(theta - old)
    textbook = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv).mean()
    decoupled = ppo_terms(theta, old, old, adv, eps, eps, behav_cap=5.0, decoupled=True)
    naive = ppo_terms(theta, None, old, adv, eps, eps, decoupled=False)
    torch.testing.assert_close(decoupled.loss.mean(), textbook)
    torch.testing.assert_close(naive.loss.mean(), textbook)
    assert not decoupled.capped.any() and (decoupled.w == 1).all()


def test_naive_ppo_ignores_proximal_and_never_caps():
    theta, prox, behav = torch.tensor([0.0]), torch.tensor([5.0]), torch.tensor([-5.0])
    t = ppo_terms(theta, prox, behav, torch.tensor([1.0]), decoupled=False)
    # ratio = exp(0 − (−5)) is clipped at 1.2; w = 1 and no capping despite p − b = 10
    torch.testing.assert_close(t.loss, torch.tensor([-1.2]))
    assert not t.capped.any()


def test_k3_kl_to_reference():
    theta, ref = torch.tensor([-1.0, -2.0], requires_grad=True), torch.tensor([-1.5, -2.0])
    t = ppo_terms(theta, theta.detach(), theta.detach(), torch.zeros(2), ref=ref, kl_coef=0.1)
    d = -0.5
    torch.testing.assert_close(t.kl, torch.tensor([math.exp(d) - d - 1, 0.0]))
    torch.testing.assert_close(t.loss, 0.1 * t.kl)  # A = 0: only the penalty remains
    t.loss.sum().backward()
    torch.testing.assert_close(theta.grad, torch.tensor([0.1 * (1 - math.exp(d)), 0.0]))  # d k3/dθ = 1 − e^(r−θ)


def test_first_minibatch_of_a_step_is_never_clipped_by_the_decoupled_objective():
    # On the first mini-batch θ = p, so ratio = 1 however stale the data: the decoupled objective is
    # then a w-weighted policy gradient with no trust region, which is why rl.ppo_minibatches
    # defaults to 4 (docs/learning.md). Naive PPO clips the same stale tokens against b instead.
    theta = torch.tensor([0.0, 0.0, 0.0, 0.0], requires_grad=True)
    prox = theta.detach().clone()
    behav = torch.tensor([LN(0.5), LN(2.0), LN(0.5), LN(2.0)])  # stale: w = exp(p − b) = 2, 0.5, 2, 0.5
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    dec = ppo_terms(theta, prox, behav, adv, behav_cap=5.0)
    naive = ppo_terms(theta, None, behav, adv, decoupled=False)
    assert not dec.clipped.any()
    assert naive.clipped.tolist() == [True, False, False, True]  # r = 2 with A > 0, r = 0.5 with A < 0
    grad = torch.autograd.grad(dec.loss.sum(), theta)[0]
    torch.testing.assert_close(grad, -adv * dec.w)  # every token moves, each by w·A
