"""Bad input and dead workers, as a user meets them on the command line: bad input ends
with exit code 2 and one line before Ray starts; a killed or hung training rank ends
with exit code 3, one line naming it and the step to resume from."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
from faults import worker_process

REPO = pathlib.Path(__file__).resolve().parents[1]
RL_CONFIG = str(REPO / "examples" / "arith" / "rlvr.yaml")
ASSETS = REPO / "tests" / "assets"
TIMEOUT_S = 240
# One xdist worker runs this module (scripts/test.sh): its command-line runs of 40-70 s each start among
# the groups, not among the single tests that fill in at the end, and its module fixture runs once.
pytestmark = pytest.mark.xdist_group("failures")

# Runs each case through the CLI in one interpreter; prints [exit code, stderr, Ray started?] per case.
CHECKER = """
import contextlib, io, json, sys
import ray
from rlsys.run import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue(), ray.is_initialized()])
print(json.dumps(results))
"""


def wait_for(path: str, process: subprocess.Popen, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.isdir(path):
        if process.poll() is not None:
            stderr = process.stderr.read()[-3000:]
            raise AssertionError(f"run ended (exit {process.returncode}) before {path}:\n{stderr}")
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def bad_inputs(tiny_model_dir, arith_files, tmp_path_factory):
    """Broken model directories, data files and reward files."""
    tmp = tmp_path_factory.mktemp("bad")
    for name, drop in (("no_tokenizer", ("tokenizer.json", "vocab.json", "tokenizer_config.json")),
                       ("no_weights", ("model.safetensors",))):
        shutil.copytree(tiny_model_dir, tmp / name, ignore=shutil.ignore_patterns(*drop))
    shutil.copytree(tiny_model_dir, tmp / "bad_config")
    (tmp / "bad_config" / "config.json").write_text('{"model_type": "no_such_architecture"}')
    (tmp / "corrupt.parquet").write_bytes(pathlib.Path(arith_files["rl_train"]).read_bytes()[:3000])
    (tmp / "syntax_error.py").write_text("def compute_score(:\n")
    from rlsys.models.tiny import TinyModelSpec, write_tiny_model

    write_tiny_model(str(tmp / "tied"), TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      tie_word_embeddings=True))
    import datasets

    datasets.Dataset.from_list([{"data_source": "x", "prompt": "1+1="}] * 4).to_parquet(str(tmp / "no_truth.parquet"))
    return tmp


@pytest.mark.quick
def test_bad_input_exits_2_with_one_line_before_ray_starts(bad_inputs, tiny_model_dir, arith_files):
    base = ["rlvr", "--config", RL_CONFIG, f"model.path={tiny_model_dir}", f"output_dir={bad_inputs / 'out'}",
            f"data.train_files=[{arith_files['rl_train']}]", f"eval.files=[{arith_files['test']}]"]
    cases = {
        f"model.path={bad_inputs / 'no_tokenizer'}": "model.path: no tokenizer files in",
        f"model.path={bad_inputs / 'no_weights'}": "model.path: no weights in",
        f"model.path={bad_inputs / 'bad_config'}": "config.json cannot be read by transformers",
        f"data.train_files=[{bad_inputs / 'corrupt.parquet'}]": "corrupt.parquet: cannot be read",
        f"data.train_files=[{bad_inputs / 'no_truth.parquet'}]": "no usable rows in",
        "reward.terms=[{path: /no/such/reward.py}]": "reward.terms[0].path: file not found: /no/such/reward.py",
        f"reward.terms=[{{path: {bad_inputs / 'syntax_error.py'}}}]":
            "reward.terms[0].path: importing", 
        "reward.terms=[{name: no_such_reward}]": "reward.terms[0].name: unknown reward 'no_such_reward'",
        f"reward.terms=[{{path: {ASSETS / 'types_reward.py'}, function: wrong_arity}}]":
            "reward.terms[0]: wrong_arity(solution_str, ground_truth, rubric) cannot be called",
        "eval.reward=no_such_reward": "eval.reward: unknown reward 'no_such_reward'",
        "parallel.dp_shard=64": "ray.cpus_per_worker: 64 workers x 1 CPUs",
        "parallel.tp=3": "parallel.tp: 3 does not divide the model's attention heads (2)",
        "parallel.pp=3": "parallel.pp: 3 pipeline stages for 2 decoder layers",
        ("parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"): "parallel.pp: 4 pipeline stages for 2 decoder",
        ("parallel.pp=2", "parallel.pp_microbatches=1"): "parallel.pp_microbatches: 1f1b needs at least pp (2)",
        (f"model.path={bad_inputs / 'tied'}", "parallel.pp=2"): "parallel.pp: the model ties its input and output",
        ("parallel.cp=2", "parallel.tp=2"): "parallel.cp: tp x cp = 4 does not divide the model's attention heads",
        "parallel.sequence_parallel=true": "parallel.sequence_parallel: needs parallel.tp > 1",
        "ray.cpus_per_worker=64": "ray.cpus_per_worker: 1 worker x 64 CPUs",
        f"data.val_files=[{arith_files['test']}]": "data.val_files: the rm stage's held-out pairs; an RL run "
                                                    "validates on eval.files",
        "rollout.max_model_len=4": "rollout.max_model_len: 4 tokens cannot hold the longest prompt (",
        ("rollout.max_model_len=100000", "rollout.engine_memory_gib=0.01"):
            "rollout.engine_memory_gib: one sequence of 100000 tokens needs 0.0954 GiB of KV cache in the engine, "
            "more than its 0.01 GiB; raise rollout.engine_memory_gib or lower rollout.max_model_len",
    }
    argvs = [base + ([override] if isinstance(override, str) else list(override)) for override in cases]
    # the eval stage's engine takes ray.cpus_per_worker CPUs: its refusal names that key
    argvs.append(["eval", "--config", "examples/arith/eval.yaml", f"model.path={tiny_model_dir}",
                  f"output_dir={bad_inputs / 'eval'}", f"eval.files=[{arith_files['test']}]", "ray.cpus_per_worker=64"])
    cases[("eval", "ray.cpus_per_worker=64")] = "ray.cpus_per_worker: 1 worker x 64 CPUs"
    # held-out preference pairs are the rm stage's
    argvs.append(["sft", "--config", "examples/arith/sft.yaml", f"model.path={tiny_model_dir}",
                  f"output_dir={bad_inputs / 'sft'}", f"data.train_files=[{arith_files['sft']}]",
                  f"data.val_files=[{arith_files['preferences']}]"])
    cases[("sft", "data.val_files")] = "data.val_files: held-out preference pairs are scored by the rm stage"
    argvs.append(["rm", "--config", "examples/arith/sft.yaml", f"model.path={tiny_model_dir}",
                  f"output_dir={bad_inputs / 'rm'}", f"data.train_files=[{arith_files['preferences']}]", "eval=null",
                  "train.val_every=5"])
    cases[("rm", "train.val_every")] = "train.val_every: it scores data.val_files, which is empty"
    result = subprocess.run([sys.executable, "-c", CHECKER, json.dumps(argvs)], capture_output=True,
                            text=True, timeout=TIMEOUT_S, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    for argv, (override, expected), (code, stderr, ray_started) in zip(argvs, cases.items(),
                                                                       json.loads(result.stdout)):
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expected in lines[0], (override, stderr)
        assert lines[0].startswith(f"rlsys {argv[0]}: error: ") and not ray_started, (override, stderr)


@pytest.fixture
def sft_run(sft_config, tmp_path):
    """An SFT run of 40 steps on 2 ranks, checkpointing every 2, as a CLI subprocess."""

    def start(*overrides: str) -> tuple[subprocess.Popen, str]:
        out = str(tmp_path / "run")
        command = [sys.executable, "-m", "rlsys.run", "sft", "--config", sft_config.path, f"output_dir={out}",
                   "train.steps=40", "train.save_every=2", "train.global_batch_size=8", "train.micro_batch_size=4",
                   "tracking.backends=[jsonl]", *overrides]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out

    return start


def test_killed_rank_ends_the_run_with_one_line_and_a_resume_step(sft_run):
    process, out = sft_run()
    wait_for(os.path.join(out, "checkpoints", "step_000002"), process)
    worker_process(os.path.join(out, "logs"), "train-1").kill()
    _, stderr = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 3, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    step = int(last.rsplit(" ", 1)[1])
    assert last.startswith("rlsys sft: error: train rank 1 (rlsys/train/1) died during sft step "), last
    assert last.endswith(f"checkpoints kept in {out}/checkpoints; re-run the same command to resume from step {step}")
    assert step >= 2 and os.path.isdir(os.path.join(out, "checkpoints", f"step_{step:06d}"))


def test_hung_collective_times_out_with_one_line(sft_run):
    """A rank frozen with SIGSTOP ends the run after train.collective_timeout_s: 20 s, far above
    what a healthy rank of this run lags its peer by on a loaded machine (a 5 s limit was passed
    by a straggler before any rank was frozen)."""
    process, out = sft_run("train.collective_timeout_s=20")
    wait_for(os.path.join(out, "checkpoints", "step_000002"), process)
    frozen = worker_process(os.path.join(out, "logs"), "train-1")
    frozen.send_signal(signal.SIGSTOP)
    try:
        _, stderr = process.communicate(timeout=TIMEOUT_S)
    finally:
        if frozen.is_running():
            frozen.kill()
    assert process.returncode == 3, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    # rank 0 times out in a collective with the frozen rank, or, when frozen after its last
    # collective of a call, the driver gives up on it 20 s after rank 0 answered
    hung = ("train rank 0 (rlsys/train/0) timed out in a collective",
            "train rank 1 (rlsys/train/1) did not answer within 20 s of its peers")
    assert any(h in last for h in hung) and "re-run the same command" in last, last
