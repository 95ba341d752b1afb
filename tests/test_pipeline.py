"""`pipeline` end to end in a subprocess, as a user runs it: pretrain -> sft -> rlvr on the tiny
model; killed during RL, re-run to resume there, re-run again to skip everything. Pretraining ends with
an eval, whose engine makes way for sft's ranks. (An eval stage runs on its own in
test_train_resume_export.)"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from hub_server import Hub, serve

from rlsys.config.loader import ConfigError, build_config
from rlsys.config.schema import PipelineConfig
from rlsys.stages.chain import finished_summary, plan_jobs

# One xdist worker runs this module (scripts/test.sh): its long command-line runs start among the first.
pytestmark = pytest.mark.xdist_group("pipeline")

TIMEOUT_S = 300
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def stage_configs(tmp_path, model_dir: str, files: dict[str, str]) -> dict[str, str]:
    """Tiny YAML configs for the three stages; returns stage name -> path."""
    common = {"ray": {"include_dashboard": False}, "tracking": {"backends": ["jsonl", "ray"]}}
    evaluation = {"files": [files["test"]], "reward": "arith", "limit": 8, "max_new_tokens": 6,
                  "engine_memory_gib": 0.1}
    stages = {
        "pretrain": {**common, "model": {"path": model_dir}, "data": {"train_files": [files["pretrain"]],
                                                                      "max_seq_len": 32},
                     "train": {"steps": 3, "global_batch_size": 8, "micro_batch_size": 4},
                     "eval": evaluation},  # its engine, kept after it, must make way for sft's ranks
        "sft": {**common, "data": {"train_files": [files["sft"]], "max_seq_len": 32},  # no eval: its time
                "train": {"steps": 3, "global_batch_size": 8, "micro_batch_size": 4}},
        "rlvr": {**common, "data": {"train_files": [files["rl_train"]]}, "reward": {"terms": [{"name": "arith"}]},
                 "rollout": {"n": 2, "max_new_tokens": 6, "engine_memory_gib": 0.1},
                 "train": {"steps": 4, "prompts_per_step": 4, "micro_batch_size": 8, "save_every": 1,
                           "keep_last": 2, "val_every": 0},
                 "eval": evaluation},
    }
    paths = {}
    for name, raw in stages.items():
        paths[name] = str(tmp_path / f"{name}.yaml")
        with open(paths[name], "w") as f:
            yaml.safe_dump(raw, f)
    return paths


@pytest.fixture
def pipeline_file(tmp_path, tiny_model_dir, arith_files) -> str:
    configs = stage_configs(tmp_path, tiny_model_dir, arith_files)
    raw = {"output_dir": str(tmp_path / "run"),
           "stages": [{"name": name, "stage": name, "config": path} for name, path in configs.items()]}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def run_pipeline(pipeline_file: str, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlsys.run", "pipeline", "--config", pipeline_file, *overrides],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def start_pipeline(pipeline_file: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlsys.run", "pipeline", "--config", pipeline_file],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for(path: str, process: subprocess.Popen, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.isdir(path):
        if process.poll() is not None:
            raise AssertionError(f"pipeline ended (exit {process.returncode}) before {path}:\n"
                                 f"{process.stdout.read()[-3000:]}")
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(0.2)


@pytest.fixture
def hub_env(tiny_model_dir, tmp_path):
    """The tiny model as the Hub's `test-org/tiny`, served on this machine (tests/hub_server.py), and the
    environment that points huggingface_hub there, with a cache of the test's own."""
    hub = Hub()
    hub.add("test-org/tiny", tiny_model_dir)
    server, url = serve(hub)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    yield hub, env | {"HF_ENDPOINT": url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    server.shutdown()


def test_pipeline_runs_resumes_after_a_kill_and_skips_finished_stages(pipeline_file, hub_env):
    """The first stage trains the model named by its Hub id, downloaded once: the re-runs that skip
    that stage find the snapshot it recorded in the cache."""
    hub, env = hub_env
    raw = yaml.safe_load(open(pipeline_file))
    raw["stages"][0]["overrides"] = ["model.path=test-org/tiny"]
    yaml.safe_dump(raw, open(pipeline_file, "w"))
    out = raw["output_dir"]
    first = start_pipeline(pipeline_file, env)
    wait_for(os.path.join(out, "rlvr", "checkpoints", "step_000002"), first)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 130, first.stdout.read()[-3000:]
    assert not os.path.isfile(os.path.join(out, "rlvr", "summary.json"))
    # rlvr's training group took sft's rank processes (the same layout); pretrain's eval engine took
    # pretrain's CPUs, so sft placed ranks of its own
    assert "ranks the last group kept" in open(os.path.join(out, "rlvr", "logs", "driver.log")).read()

    second = run_pipeline(pipeline_file, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    stages = {s["name"]: s for s in json.load(open(os.path.join(out, "summary.json")))["stages"]}
    assert list(stages) == ["pretrain", "sft", "rlvr"]
    assert stages["pretrain"]["status"] == stages["sft"]["status"] == "skipped (finished earlier)"
    assert stages["rlvr"]["status"].startswith("resumed from step ")
    assert int(stages["rlvr"]["status"].split()[-1]) >= 2
    assert 0 <= stages["pretrain"]["accuracy_after"] <= 1 and stages["sft"]["accuracy_after"] is None
    assert 0 <= stages["rlvr"]["accuracy_before"] <= 1 and 0 <= stages["rlvr"]["accuracy_after"] <= 1, stages["rlvr"]
    # each stage started from the previous one's model
    assert yaml.safe_load(open(os.path.join(out, "rlvr", "config.yaml")))["model"]["path"] == \
        os.path.join(out, "sft", "hf_model")
    assert "| rlvr | rlvr | resumed from step" in second.stdout
    page = open(os.path.join(out, "report.html")).read()
    assert page.count("data:image/png;base64,") == 3  # pretrain, sft, rlvr curves

    third = run_pipeline(pipeline_file, env=env)
    assert third.returncode == 0, third.stderr[-3000:]
    assert third.stdout.count("skipped (finished earlier)") == 3
    assert "Started a local Ray instance" not in third.stderr
    pretrained_from = yaml.safe_load(open(os.path.join(out, "pretrain", "config.yaml")))["model"]["path"]
    assert pretrained_from.startswith(env["HF_HOME"]) and os.path.isfile(os.path.join(pretrained_from, "config.json"))
    assert hub.downloads[("test-org/tiny", "config.json")] == 1


@pytest.mark.quick
def test_pipeline_refuses_a_finished_stage_with_a_changed_config(pipeline_file, tmp_path):
    raw = yaml.safe_load(open(pipeline_file))
    jobs = plan_jobs(build_config(PipelineConfig, raw))
    os.makedirs(jobs[0].output_dir)
    from rlsys.stages.run_dir import prepare_run_dir, write_summary

    prepare_run_dir(jobs[0], "pretrain")
    write_summary(jobs[0].output_dir, {"stage": "pretrain"})
    raw["stages"][0]["overrides"] = ["train.steps=5"]
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = run_pipeline(str(path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"rlsys pipeline: error: stages[0] (pretrain): finished in {jobs[0].output_dir} with a different config "
        f"(train.steps: 3 -> 5); delete that directory to run the stage again"]


@pytest.mark.quick
def test_a_stage_finished_before_a_config_key_was_added_stays_finished(pipeline_file):
    """A finished stage's recorded config is read by today's schema: keys added since (here a reward
    term's model settings and algorithm.distill) take their defaults and change nothing, nor does
    where its metrics went (`tracking`); a value that differs still does."""
    from rlsys.stages.run_dir import prepare_run_dir, write_summary

    pipeline = build_config(PipelineConfig, yaml.safe_load(open(pipeline_file)))
    job, spec = plan_jobs(pipeline)[2], pipeline.stages[2]
    os.makedirs(job.output_dir)
    prepare_run_dir(job, "rlvr")
    write_summary(job.output_dir, {"stage": "rlvr"})
    path = os.path.join(job.output_dir, "config.yaml")
    recorded = yaml.safe_load(open(path))
    for key in ("model", "judge", "normalize", "serving"):
        del recorded["reward"]["terms"][0][key]
    del recorded["algorithm"]["distill"]
    recorded["tracking"].update(wandb_mode="offline", backends=["console"])
    yaml.safe_dump(recorded, open(path, "w"))
    assert finished_summary(2, spec, job) == {"stage": "rlvr"}

    recorded["reward"]["terms"][0]["weight"] = 2.0
    yaml.safe_dump(recorded, open(path, "w"))
    with pytest.raises(ConfigError, match=r"with a different config \(reward.terms: "):
        finished_summary(2, spec, job)


@pytest.mark.quick
def test_a_pipeline_chains_sft_into_a_reward_model_and_rl(tmp_path, pipeline_file):
    """sft -> rm -> rlvr: the rm stage starts from the SFT model and passes it on, so RL starts from
    it too, and the RL stage's `model: stage:rm` term is the rm stage's export."""
    raw = yaml.safe_load(open(pipeline_file))
    stages = {s["name"]: s for s in raw["stages"]}
    rl = yaml.safe_load(open(stages["rlvr"]["config"]))
    rl["reward"]["terms"].append({"name": "rm", "model": "stage:rm", "weight": 0.5})
    yaml.safe_dump(rl, open(stages["rlvr"]["config"], "w"))
    raw["stages"] = [stages["sft"], {"name": "rm", "stage": "rm", "config": stages["sft"]["config"]}, stages["rlvr"]]
    jobs = plan_jobs(build_config(PipelineConfig, raw))
    sft_model = os.path.join(raw["output_dir"], "sft", "hf_model")
    assert jobs[1].model.path == jobs[2].model.path == sft_model
    assert jobs[2].reward.terms[1].model == os.path.join(raw["output_dir"], "rm", "hf_model")
    raw["stages"][1]["name"] = "scorer"
    with pytest.raises(ConfigError, match=r"stages\[2\] \(rlvr\): reward.terms\[1\].model: no earlier rm stage "
                                          r"is named 'rm' \(rm stages: scorer\)"):
        plan_jobs(build_config(PipelineConfig, raw))


@pytest.mark.quick
def test_a_pipeline_seed_reruns_every_stage_at_that_seed(pipeline_file):
    """`seed=S` on the pipeline's command line sets every stage's seed, a stage's own override
    included; without it each stage keeps its config's."""
    raw = yaml.safe_load(open(pipeline_file))
    raw["stages"][1]["overrides"] = ["seed=7"]
    assert [job.seed for job in plan_jobs(build_config(PipelineConfig, raw))] == [0, 7, 0]
    assert [job.seed for job in plan_jobs(build_config(PipelineConfig, {**raw, "seed": 2}))] == [2, 2, 2]


@pytest.mark.parametrize("change, message", [
    ({"stages": []}, "stages: give at least one stage"),
    ({"stages": [{"name": "a", "stage": "sft", "config": "x.yaml"}] * 2},
     "stages[1].name: 'a' is used by an earlier stage"),
    ({"stages": [{"name": "a", "stage": "dpo", "config": "x.yaml"}]}, "stages.0.stage"),
    ({"stages": [{"name": "a", "stage": "sft", "config": "missing.yaml"}]},
     "stages[0] (a): --config: file not found: missing.yaml"),
])
@pytest.mark.quick
def test_bad_pipeline_configs_name_the_key(change, message, tmp_path):
    raw = {"output_dir": str(tmp_path / "run"), **change}
    with pytest.raises(ConfigError) as err:
        plan_jobs(build_config(PipelineConfig, raw))
    assert message in str(err.value)


@pytest.mark.quick
def test_the_main_job_reads_what_its_prepare_writes_and_the_spread_reruns_it_per_seed_and_layout(tmp_path):
    """Every file the main job's stages read is one examples/arith/prepare.py writes (SFT's the careless
    teacher's); examples/arith/spread.py runs the same stages with its seed, layout and data."""
    loader = importlib.util.spec_from_file_location("spread", os.path.join(EXAMPLES, "arith", "spread.py"))
    spread = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(spread)
    out, data = str(tmp_path / "runs" / "arith"), str(tmp_path / "data")
    spread.prepare(out, data_dir=data)
    jobs = plan_jobs(build_config(PipelineConfig, spread.run_config(out, data, seed=2, threads=2)))
    pretrain, sft, rlvr, evaluation = jobs
    read = [*pretrain.data.train_files, *sft.data.train_files, *rlvr.data.train_files, *evaluation.eval.files]
    assert all(os.path.isfile(path) and path.startswith(data) for path in read), read
    assert sft.data.train_files == [os.path.join(data, "sft_careless.jsonl")]
    assert pretrain.model.path == os.path.join(out, "tiny-init")
    assert os.path.isfile(os.path.join(out, "tiny-init", "config.json"))
    assert [job.seed for job in (pretrain, sft, rlvr)] == [2, 2, 2]
    assert [pretrain.parallel.dp_shard, sft.parallel.dp_shard, rlvr.ray.cpus_per_worker] == [1, 1, 2]
    one_thread = plan_jobs(build_config(PipelineConfig, spread.run_config(out, data, seed=0, threads=1)))
    assert [one_thread[0].parallel.dp_shard, one_thread[1].parallel.dp_shard, one_thread[2].ray.cpus_per_worker] == \
        [2, 2, 1]
    with open(os.path.join(EXAMPLES, "arith", "pipeline.yaml")) as f:
        main_job = plan_jobs(build_config(PipelineConfig, yaml.safe_load(f)))
    assert [os.path.basename(path) for path in main_job[1].data.train_files] == ["sft_careless.jsonl"]
