"""Rewards by name, file or package, VeRL signatures and data as stored, and failures
that are counted, not fatal."""

from __future__ import annotations

import json
import os
import time

import datasets
import pytest

from rlsys.actors.reward_pool import RewardPool
from rlsys.config.loader import ConfigError
from rlsys.config.rl import RewardConfig, RewardTerm
from rlsys.data.rl import load_prompts
from rlsys.rewards.scoring import RewardInput

pytestmark = pytest.mark.quick  # the quick tier (scripts/test.sh --quick)

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
FLAKY = os.path.join(ASSETS, "flaky_reward.py")
TYPES = os.path.join(ASSETS, "types_reward.py")


def inputs(*responses: str) -> list[RewardInput]:
    return [RewardInput("test", r, "7", {}) for r in responses]


@pytest.fixture
def runner():
    """Builds RewardPools and shuts every one down after the test."""
    made = []

    def make(*terms: RewardTerm, **options) -> RewardPool:
        made.append(RewardPool(RewardConfig(terms=list(terms), **options)))
        return made[-1]

    yield make
    for r in made:
        r.shutdown()


def test_file_reward_failures_score_zero_and_are_counted(ray_cluster, runner, caplog):
    rewards = runner(RewardTerm(path=FLAKY), timeout_s=1.0, num_workers=2)
    rewards.score(inputs("7", "7"))  # the workers start before the clock: it times the scoring alone
    started = time.time()
    scored, metrics = rewards.score(inputs("7", "raise", "sleep", "nan", "8", "7"))
    assert time.time() - started < 20
    assert [s.score for s in scored] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert metrics["reward/errors"] == 3
    assert metrics["reward/length"] == pytest.approx((1 + 1 + 1) / 3)  # extras of the dict returns
    assert "this reward fails on purpose" in caplog.text and "exceeded 1s" not in caplog.text  # logged once
    rewards.score(inputs("raise"))
    assert caplog.text.count("logged once") == 1


def test_weighted_terms_and_batched_form(ray_cluster, runner):
    rewards = runner(RewardTerm(name="arith", weight=1.0),
                     RewardTerm(name="regex_format", weight=0.5, kwargs={"pattern": r"-?\d+"}),
                     RewardTerm(path=FLAKY, function="batched_score", batched=True, weight=2.0))
    scored, metrics = rewards.score(inputs("7", "8", "x"))
    assert [s.score for s in scored] == [1.0 + 0.5 + 2.0, 0.5, 0.0]
    assert metrics["reward/arith"] == pytest.approx(1 / 3) and metrics["reward/errors"] == 0


def write_rl_parquet(path, ground_truths: list) -> str:
    rows = [{"data_source": "typed", "prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"style": "rule", "ground_truth": truth},
             "extra_info": {"stored": json.dumps(truth, sort_keys=True), "type": type(truth).__name__}}
            for i, truth in enumerate(ground_truths)]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


@pytest.mark.parametrize("ground_truths", [
    [{"target": 24, "numbers": [3, 5, 8]}, {"target": 7, "numbers": [1, 2, 4]}],  # countdown's dicts
    [[1, 2, 3], [4]],  # lists (test cases, several answers)
    [42, 7],
    ["19", "-3"],
], ids=["dict", "list", "number", "string"])
def test_ground_truth_reaches_the_reward_as_stored(ray_cluster, runner, tmp_path, tiny_model_dir, ground_truths):
    from transformers import AutoTokenizer

    path = write_rl_parquet(tmp_path / "typed.parquet", ground_truths)
    prompts, stats = load_prompts([path], AutoTokenizer.from_pretrained(tiny_model_dir))
    assert stats.skipped == 0 and [p.ground_truth for p in prompts] == ground_truths
    rewards = runner(RewardTerm(path=TYPES))
    scored, metrics = rewards.score([RewardInput(p.data_source, "x", p.ground_truth, p.extra_info) for p in prompts])
    assert metrics["reward/errors"] == 0 and [s.score for s in scored] == [1.0, 1.0]


def test_reward_importing_a_sibling_module_scores_without_errors(ray_cluster, runner):
    rewards = runner(RewardTerm(path=os.path.join(ASSETS, "verl_reward", "my_reward.py")))
    scored, metrics = rewards.score([RewardInput("openai/gsm8k", "so #### 72", "72", None),
                                     RewardInput("openai/gsm8k", "#### 1,000", "1000", None),
                                     RewardInput("openai/gsm8k", "72", "72", None)])
    assert metrics["reward/errors"] == 0 and [s.score for s in scored] == [1.0, 1.0, 0.0]


def test_a_kept_worker_forgets_what_the_last_reward_imported_beside_it(ray_cluster, runner, tmp_path):
    """Reward workers outlive their pool for the next pool of the same size (`rlsys.actors.kept_actors`,
    on in this suite). A reward that imports a module beside it when called gets its own module in a
    kept worker, not the module of the same name an earlier pool's reward imported there."""
    from rlsys.actors import kept_actors

    for score in (1, 2):
        folder = tmp_path / f"reward{score}"
        folder.mkdir()
        (folder / "helper.py").write_text(f"SCORE = {score}.0\n")
        (folder / "reward.py").write_text(
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    import helper\n\n    return helper.SCORE\n")
    kept_actors.retire()  # the first pool starts its worker
    pids, scores = [], []
    for score in (1, 2):
        rewards = RewardPool(RewardConfig(terms=[RewardTerm(path=str(tmp_path / f"reward{score}" / "reward.py"))],
                                          num_workers=1))
        try:
            scored, metrics = rewards.score(inputs("7"))
            pids.append(rewards._workers.on_each(lambda worker: os.getpid())[0])
        finally:
            rewards.shutdown()
        assert metrics["reward/errors"] == 0
        scores.append(scored[0].score)
    assert pids[0] == pids[1] and scores == [1.0, 2.0]


def test_reward_package_with_a_dict_ground_truth(ray_cluster, runner):
    rewards = runner(RewardTerm(path=os.path.join(ASSETS, "countdown_reward")))
    truth = {"target": 24, "numbers": [3, 5, 8]}
    scored, metrics = rewards.score([RewardInput("countdown", "(5+3)*3", truth, None),
                                     RewardInput("countdown", "3*8", {"target": 24, "numbers": [3, 8]}, None),
                                     RewardInput("countdown", "5*8-3", truth, None)])
    assert metrics["reward/errors"] == 0 and [s.score for s in scored] == [0.0, 1.0, 0.0]


def test_verl_per_source_signature_gets_fields_by_name(ray_cluster, runner):
    rewards = runner(RewardTerm(path=TYPES, function="by_keyword"))
    scored, metrics = rewards.score([RewardInput("src", "7", 7, None), RewardInput("src", "8", 7, None)])
    assert metrics["reward/errors"] == 0 and [s.score for s in scored] == [1.0, 0.0]


def test_bad_reward_config_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"reward.terms\[0\].name: unknown reward 'nope'"):
        RewardPool(RewardConfig(terms=[RewardTerm(name="nope")]))
    with pytest.raises(ConfigError, match=r"reward.terms\[0\].function: .* has no function 'missing'"):
        RewardPool(RewardConfig(terms=[RewardTerm(path=FLAKY, function="missing")]))
    with pytest.raises(ConfigError, match=r"reward.terms\[0\]: wrong_arity\(solution_str, ground_truth, rubric\) "
                                         r"cannot be called with \(data_source, .*missing a required "
                                         r"argument: 'rubric'"):
        RewardPool(RewardConfig(terms=[RewardTerm(path=TYPES, function="wrong_arity")]))
    broken = tmp_path / "broken.py"
    broken.write_text("import nonexistent_module_xyz\n")
    with pytest.raises(ConfigError, match=r"reward.terms\[0\].path: importing .* failed: ModuleNotFoundError"):
        RewardPool(RewardConfig(terms=[RewardTerm(path=str(broken))]))


def test_a_name_takes_one_definition_however_often_it_is_imported():
    """The task modules run as scripts (`python -m rlsys.tasks.arith`) while their package imports
    them too: the same definition registers once; another function under the name is refused."""
    from rlsys.registry import Registry
    from rlsys.tasks import arith

    registry = Registry("reward")
    registry.register("arith", arith.reward)
    namespace = {}
    exec(compile(open(arith.__file__).read(), arith.__file__, "exec"), namespace)  # the module run again
    registry.register("arith", namespace["reward"])
    with pytest.raises(ValueError, match="reward 'arith' is already registered"):
        registry.register("arith", lambda *args: 0.0)


def test_a_reward_worker_imports_neither_torch_nor_transformers():
    """A reward actor imports its worker module and what scoring needs, no more: each of a pool's
    workers would otherwise pay torch's and transformers' start-up and memory."""
    import subprocess
    import sys

    probe = ("import sys, rlsys.actors.reward_worker; "
             "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_the_counting_reward_scores_the_run_written_in_order():
    """`counting` (the long-answer task): the whole range alone 1.0, a restated question costs nothing,
    stopping early or running past the end costs the share missed or added, nothing in order 0."""
    from rlsys.tasks.counting import reward

    def score(response: str) -> float:
        return reward("counting", response, "41-45")

    assert score("41, 42, 43, 44, 45") == 1.0
    assert score("The numbers from 41 to 45 are: 41, 42, 43, 44, 45") == 1.0
    assert score("41, 42, 43") == pytest.approx(3 / 5)
    assert score("41, 42, 43, 44, 45, 46, 47") == pytest.approx(5 / 7)
    assert score("41, 43, 42") == pytest.approx(1 / 7)  # the run "41", then 2 numbers after it
    assert score("") == 0.0 and score("45, 44, 43") == 0.0
