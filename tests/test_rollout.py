"""A rollout engine in this process: seeded sampling and the responses' text."""

from __future__ import annotations

import pytest

from rlsys.config.schema import RolloutConfig


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    from rlsys.actors.rollout_worker import RolloutWorker

    return RolloutWorker(tiny_model_dir, RolloutConfig(engine_memory_gib=0.1), seed=0, num_threads=2)


def test_a_step_of_long_prompts_samples_each_prompt_as_it_would_alone(worker, tiny_model_dir):
    """24 prompts of 200 tokens overflow vLLM's 4,096-token pass: on CPU a prompt split across
    passes crashed seeded sampling. Each prompt's samples depend on its seed only, not on the
    batch it came in, and their text is their tokens decoded."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [(i, tokenizer(f"{i:02d}+{i:02d}=" * 40)["input_ids"][:200]) for i in range(24)]
    assert {len(ids) for _, ids in prompts} == {200}
    sample = dict(n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=3)

    together = worker.generate(prompts, **sample).samples(dict(prompts))
    alone = worker.generate(prompts[17:18], **sample).samples(dict(prompts))

    assert len(together) == 48 and all(s.response_ids for s in together)
    mine = [s for s in together if s.prompt_index == 17]
    assert [s.response_ids for s in mine] == [s.response_ids for s in alone]
    for a, b in zip(mine, alone):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert len({tuple(s.response_ids) for s in together}) > 10  # the seeds differ by prompt
    assert [s.text for s in together] == [tokenizer.decode(s.response_ids, skip_special_tokens=True)
                                          for s in together]
