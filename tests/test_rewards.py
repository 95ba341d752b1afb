"""Rewards by name or file path, VeRL signatures, and failures that are counted, not fatal."""

from __future__ import annotations

import os
import time

import pytest

from rlsys.config.loader import ConfigError
from rlsys.config.schema import RewardConfig, RewardTerm
from rlsys.rewards.runner import RewardInput, RewardRunner

FLAKY = os.path.join(os.path.dirname(__file__), "assets", "flaky_reward.py")


def inputs(*responses: str) -> list[RewardInput]:
    return [RewardInput("test", r, "7", {}) for r in responses]


def test_file_reward_failures_score_zero_and_are_counted(ray_cluster, caplog):
    runner = RewardRunner(RewardConfig(terms=[RewardTerm(path=FLAKY)], timeout_s=1.0, num_workers=2))
    started = time.time()
    scored, metrics = runner.score(inputs("7", "raise", "sleep", "nan", "8", "7"))
    assert time.time() - started < 20
    assert [s.score for s in scored] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert metrics["reward/errors"] == 3
    assert metrics["reward/length"] == pytest.approx((1 + 1 + 1) / 3)  # extras of the dict returns
    assert "this reward fails on purpose" in caplog.text and "exceeded 1s" not in caplog.text  # logged once
    runner.score(inputs("raise"))
    assert caplog.text.count("logged once") == 1


def test_weighted_terms_and_batched_form(ray_cluster):
    cfg = RewardConfig(terms=[
        RewardTerm(name="arith", weight=1.0),
        RewardTerm(name="regex_format", weight=0.5, kwargs={"pattern": r"-?\d+"}),
        RewardTerm(path=FLAKY, function="batched_score", batched=True, weight=2.0),
    ])
    scored, metrics = RewardRunner(cfg).score(inputs("7", "8", "x"))
    assert [s.score for s in scored] == [1.0 + 0.5 + 2.0, 0.5, 0.0]
    assert metrics["reward/arith"] == pytest.approx(1 / 3) and metrics["reward/errors"] == 0


def test_bad_reward_config_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"reward.terms\[0\].name: unknown reward 'nope'"):
        RewardRunner(RewardConfig(terms=[RewardTerm(name="nope")]))
    with pytest.raises(ConfigError, match=r"reward.terms\[0\].function: .* has no function 'missing'"):
        RewardRunner(RewardConfig(terms=[RewardTerm(path=FLAKY, function="missing")]))
    broken = tmp_path / "broken.py"
    broken.write_text("import nonexistent_module_xyz\n")
    with pytest.raises(ConfigError, match=r"reward.terms\[0\].path: importing .* failed: ModuleNotFoundError"):
        RewardRunner(RewardConfig(terms=[RewardTerm(path=str(broken))]))
