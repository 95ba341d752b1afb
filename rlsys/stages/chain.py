"""`pipeline`: stages in order, each starting from the previous stage's final model.

Every stage's config is loaded and validated before the first one starts. A
stage whose summary.json exists is finished: a re-run skips it (provided its
recorded config still matches, `tracking` aside) and an interrupted stage resumes from its own
checkpoints. The end prints a table of each stage's accuracy before and after
and its time, and writes it with a report page to the pipeline's output_dir.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass

import yaml

from rlsys.actors import kept_actors
from rlsys.actors.phases import set_phase
from rlsys.config.loader import ConfigError, build_config, config_to_dict, load_config
from rlsys.config.schema import EvalJobConfig, PipelineConfig, PipelineStage, RLJobConfig, TrainJobConfig
from rlsys.stages.preflight import resolve_models
from rlsys.stages.run_dir import CONFIG_FILE, HF_MODEL_DIR, SUMMARY_FILE

log = logging.getLogger(__name__)

STAGE_SCHEMAS = {"pretrain": TrainJobConfig, "sft": TrainJobConfig, "rm": TrainJobConfig, "rlvr": RLJobConfig,
                 "eval": EvalJobConfig}
STAGE_MODEL = "stage:"
"""A reward term's `model: stage:<name>` in a pipeline's rlvr stage is the reward model an earlier
`rm` stage of that name exported."""


@dataclass
class StageResult:
    name: str
    stage: str
    status: str
    """ran, resumed from step N, or skipped (finished earlier)."""
    steps: int | None
    accuracy_before: float | None
    accuracy_after: float | None
    time_s: float | None
    output_dir: str


def run_pipeline(cfg: PipelineConfig) -> dict:
    jobs = plan_jobs(cfg)
    started = time.time()
    results: list[StageResult] = []
    kept_actors.keep_actors(True)  # a stage whose layout is the last one's takes its ranks' processes
    try:
        for index, (spec, job) in enumerate(zip(cfg.stages, jobs)):
            finished = finished_summary(index, spec, job)
            if finished is None:
                log.info("pipeline: stage %d/%d %r (%s) in %s", index + 1, len(jobs), spec.name, spec.stage,
                         job.output_dir)
                set_phase(f"{spec.stage}: checks and data")  # until the stage names its own phases
                summary, status = _run_stage(spec.stage, job), None
            else:
                log.info("pipeline: stage %r already finished in %s; skipped", spec.name, job.output_dir)
                summary, status = finished, "skipped (finished earlier)"
            results.append(_result(spec, job, summary, status, results[-1] if results else None))
    finally:
        kept_actors.keep_actors(False)
    table = summary_table(results)
    print(table)
    return _write_outputs(cfg, results, table, time.time() - started)


def plan_jobs(cfg: PipelineConfig) -> list:
    """Every stage's validated config, with output_dir/<name> and the chained model.path. An `eval`
    or `rm` stage passes its input model on (a reward model is not the next stage's policy); a
    reward term's `model: stage:<name>` is that earlier rm stage's export."""
    _check_pipeline(cfg)
    jobs, model, reward_models = [], None, {}
    for index, spec in enumerate(cfg.stages):
        try:
            job = load_config(STAGE_SCHEMAS[spec.stage], spec.config, spec.overrides)
            if spec.stage == "rlvr":
                job = _with_stage_reward_models(job, reward_models)
        except ConfigError as err:
            raise ConfigError(f"stages[{index}] ({spec.name}): {err}") from None
        job = dataclasses.replace(job, output_dir=os.path.join(cfg.output_dir, spec.name),
                                  seed=job.seed if cfg.seed is None else cfg.seed)
        if model is not None:
            job = dataclasses.replace(job, model=dataclasses.replace(job.model, path=model))
        exported = os.path.join(job.output_dir, HF_MODEL_DIR)
        if spec.stage == "rm":
            reward_models[spec.name] = exported
        model = job.model.path if spec.stage in ("eval", "rm") else exported
        jobs.append(job)
    return jobs


def _with_stage_reward_models(job: RLJobConfig, reward_models: dict[str, str]) -> RLJobConfig:
    terms = []
    for i, term in enumerate(job.reward.terms):
        if term.model.startswith(STAGE_MODEL):
            name = term.model[len(STAGE_MODEL):]
            if name not in reward_models:
                raise ConfigError(f"reward.terms[{i}].model: no earlier rm stage is named {name!r} "
                                  f"(rm stages: {', '.join(reward_models) or 'none'})")
            term = dataclasses.replace(term, model=reward_models[name])
        terms.append(term)
    return dataclasses.replace(job, reward=dataclasses.replace(job.reward, terms=terms))


def summary_table(results: list[StageResult]) -> str:
    lines = ["| stage | kind | status | steps | accuracy before | accuracy after | change | time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        change = (f"{(r.accuracy_after - r.accuracy_before) * 100:+.1f} pt"
                  if r.accuracy_before is not None and r.accuracy_after is not None else "")
        time_text = f"{r.time_s:.0f} s" if r.time_s is not None else ""
        lines.append(f"| {r.name} | {r.stage} | {r.status} | {r.steps or ''} | {_percent(r.accuracy_before)} | "
                     f"{_percent(r.accuracy_after)} | {change} | {time_text} |")
    return "\n".join(lines)


def _check_pipeline(cfg: PipelineConfig) -> None:
    if not cfg.output_dir:
        raise ConfigError("output_dir: required")
    if not cfg.stages:
        raise ConfigError("stages: give at least one stage")
    seen = set()
    for index, spec in enumerate(cfg.stages):
        if not spec.name or "/" in spec.name or spec.name in (".", ".."):
            raise ConfigError(f"stages[{index}].name: {spec.name!r} is not a usable directory name")
        if spec.name in seen:
            raise ConfigError(f"stages[{index}].name: {spec.name!r} is used by an earlier stage")
        seen.add(spec.name)
        if not spec.config:
            raise ConfigError(f"stages[{index}].config: required (the stage's YAML file)")


def finished_summary(index: int, spec: PipelineStage, job) -> dict | None:
    """The stage's summary when it finished earlier with this same config, else None."""
    summary_path = os.path.join(job.output_dir, SUMMARY_FILE)
    if not os.path.isfile(summary_path):
        return None
    with open(os.path.join(job.output_dir, CONFIG_FILE)) as f:
        recorded = _in_current_schema(type(job), yaml.safe_load(f))
    resolve_models(job)  # the stage recorded its models' snapshots, not the Hub ids
    difference = _first_difference(_what_it_computes(recorded), _what_it_computes(_plain(job)))
    if difference:
        raise ConfigError(f"stages[{index}] ({spec.name}): finished in {job.output_dir} with a different config "
                          f"({difference}); delete that directory to run the stage again")
    with open(summary_path) as f:
        return json.load(f)


def _in_current_schema(job_type: type, recorded: dict) -> dict:
    """The recorded config as today's schema reads it: a key added since it was written takes its
    default, so an upgrade alone does not make a finished stage look changed. One the schema no
    longer reads is compared as written (and so differs)."""
    try:
        return _plain(build_config(job_type, recorded))
    except ConfigError:
        return recorded


def _what_it_computes(config: dict) -> dict:
    """A stage's config less `tracking`: where its metrics went changes none of its results."""
    return {key: value for key, value in config.items() if key != "tracking"}


def _plain(job) -> dict:
    return yaml.safe_load(yaml.safe_dump(config_to_dict(job), sort_keys=False))


def _first_difference(old, new, prefix: str = "") -> str | None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in dict.fromkeys([*old, *new]):
            found = _first_difference(old.get(key), new.get(key), f"{prefix}{key}.")
            if found:
                return found
        return None
    return None if old == new else f"{prefix.rstrip('.')}: {old!r} -> {new!r}"


def _run_stage(stage: str, job) -> dict:
    if stage == "rlvr":
        from rlsys.stages.rl_trainer import run_rlvr

        return run_rlvr(job)
    if stage == "eval":
        from rlsys.stages.eval import run_eval

        return run_eval(job)
    from rlsys.stages.lm_trainer import run_lm_training

    return run_lm_training(job, stage)


def _result(spec: PipelineStage, job, summary: dict, status: str | None,
            previous: StageResult | None) -> StageResult:
    if spec.stage == "rlvr":
        before, after = summary.get("val_accuracy_before"), summary.get("val_accuracy_after")
    elif spec.stage == "rm":  # a reward model answers nothing
        before = after = None
    elif spec.stage == "eval":
        before, after = None, summary.get("accuracy")
    else:
        before, after = None, (summary.get("eval") or {}).get("accuracy")
    if before is None and previous is not None and spec.stage != "rm":
        before = previous.accuracy_after  # the same model, measured at the previous stage's end
    resumed = summary.get("resumed_from_step")
    if status is None:
        status = f"resumed from step {resumed}" if resumed else "ran"
    return StageResult(spec.name, spec.stage, status, summary.get("steps"), before, after,
                       summary.get("time_s"), job.output_dir)


def _write_outputs(cfg: PipelineConfig, results: list[StageResult], table: str, elapsed: float) -> dict:
    from rlsys.report import write_pipeline_report

    os.makedirs(cfg.output_dir, exist_ok=True)
    summary = {"stages": [dataclasses.asdict(r) for r in results], "time_s": round(elapsed, 1)}
    with open(os.path.join(cfg.output_dir, SUMMARY_FILE), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(cfg.output_dir, "summary.md"), "w") as f:
        f.write(table + "\n")
    report = write_pipeline_report(cfg.output_dir, table, {r.name: r.output_dir for r in results})
    log.info("pipeline: finished in %.0f s; table in %s, report %s", elapsed,
             os.path.join(cfg.output_dir, "summary.md"), report)
    return summary


def _percent(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"
