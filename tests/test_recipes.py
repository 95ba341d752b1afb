"""The GSM8K recipes (examples/gsm8k) as a GPU user runs them: each passes the checks its stage makes
before it starts (`--dry-run`) on a cluster of the GPUs it is written for, with the tiny model and the
arithmetic problems in place of the Hub's model and GSM8K; and each sets the layout and resources
that `plan` recommends for its model's shape on those GPUs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import yaml
from cli_runs import run_commands

from rlsys.planner.job import PlanArgs, load_job, run_plan

pytestmark = pytest.mark.quick


@dataclass(frozen=True)
class Recipe:
    file: str
    gpus: int
    shape: str
    """A directory with the model's config.json alone: the planner needs its shape, not its weights."""


RECIPES = [Recipe("examples/gsm8k/grpo_qwen2.5-0.5b_1gpu.yaml", 1, "examples/plan/qwen2.5-0.5b"),
           Recipe("examples/gsm8k/grpo_qwen2.5-7b_8gpu.yaml", 8, "examples/plan/qwen2.5-7b"),
           Recipe("examples/gsm8k/grpo_qwen2.5-7b_2nodes.yaml", 16, "examples/plan/qwen2.5-7b")]
GPU_MEMORY_GIB = 80
PROMPT_TOKENS = 512


def test_each_recipe_passes_the_checks_of_its_stage_on_its_gpus(tiny_model_dir, arith_files, tmp_path):
    stand_ins = [f"model.path={tiny_model_dir}", f"data.train_files=[{arith_files['rl_train']}]",
                 f"eval.files=[{arith_files['test']}]", f"output_dir={tmp_path}"]
    runs = [[recipe.file, *stand_ins, f"ray.num_gpus={recipe.gpus}", f"ray.num_cpus={2 * recipe.gpus}"]
            for recipe in RECIPES]
    half = [RECIPES[1].file, *stand_ins, "ray.num_gpus=4", "ray.num_cpus=16"]  # the 8-GPU recipe on 4 GPUs
    results = run_commands([(["rlvr", "--dry-run", "--config", *run], {}) for run in [*runs, half]])
    for recipe, (code, out, err) in zip(RECIPES, results):
        assert (code, out.strip()) == (0, f"rlsys rlvr: {recipe.file} passes the checks a run makes before it "
                                          f"starts"), err
    code, _, err = results[3]
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "rlsys rlvr: error: ray.gpus_per_worker: 8 workers x 1 GPUs = 8 GPUs, but the Ray cluster has 4"), err


@pytest.mark.parametrize("recipe", RECIPES, ids=[os.path.basename(r.file) for r in RECIPES])
def test_each_recipe_sets_the_layout_and_resources_plan_recommends(recipe):
    raw = yaml.safe_load(open(recipe.file))
    shape = [f"model.path={recipe.shape}"]
    recommended = run_plan(PlanArgs(recipe.file, shape, recipe.gpus, GPU_MEMORY_GIB, prompt_tokens=PROMPT_TOKENS))
    assert recommended["parallel"] == load_job(recipe.file, shape, recipe.gpus).parallel
    assert recommended["resources"] == (f"ray.gpus_per_worker={raw['ray']['gpus_per_worker']} "
                                        f"rollout.num_engines={raw['rollout']['num_engines']}")


def test_gsm8k_rows_read_as_prompts_that_the_gsm8k_reward_scores(tiny_model_dir, tmp_path):
    """prepare.py's rows (VeRL's schema) load as chat prompts; the reward takes their ground truth."""
    import datasets
    from transformers import AutoTokenizer

    from rlsys.data.rl import load_prompts
    from rlsys.rewards.builtin import gsm8k

    spec = importlib.util.spec_from_file_location("gsm8k_prepare", "examples/gsm8k/prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    INSTRUCTION, to_row = prepare.INSTRUCTION, prepare.to_row  # noqa: N806

    example = {"question": "Tom has 1,200 apples and eats 3. How many are left?",
               "answer": "1200 - 3 = <<1200-3=1197>>1197\n#### 1,197"}
    path = str(tmp_path / "train.parquet")
    datasets.Dataset.from_list([to_row(example, "train", 0)]).to_parquet(path)
    [prompt], _ = load_prompts([path], AutoTokenizer.from_pretrained(tiny_model_dir))
    assert prompt.messages == [{"role": "user", "content": f"{example['question']} {INSTRUCTION}"}]
    assert prompt.ground_truth == "1197" and prompt.data_source == "openai/gsm8k"
    assert gsm8k(prompt.data_source, "1200 - 3 = 1197\n#### 1,197", prompt.ground_truth) == 1.0
    assert gsm8k(prompt.data_source, "#### 1198", prompt.ground_truth) == 0.0


def test_gsm8k_prepare_without_the_hub_or_a_cached_copy_says_so_in_one_line(tmp_path):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environment |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "examples/gsm8k/prepare.py", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("examples/gsm8k/prepare.py: cannot read openai/gsm8k from the Hub or the cache: ")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
