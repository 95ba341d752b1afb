"""A rollout engine in this process: requests served one by one sample what vLLM's batch
`generate` samples; seeded sampling does not depend on the batch; the responses' text."""

from __future__ import annotations

import asyncio

import pytest

from rlsys.agents.loop import SingleTurnLoop
from rlsys.agents.trajectory import Sampling
from rlsys.config.rollout import RolloutConfig

# One xdist worker runs this module (scripts/test.sh): the engine its tests share, built once.
pytestmark = pytest.mark.xdist_group("rollout")


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    from rlsys.actors.rollout_worker import RolloutWorker, RolloutWorkerSpec

    return RolloutWorker(RolloutWorkerSpec(tiny_model_dir, RolloutConfig(engine_memory_gib=0.1), seed=0, num_threads=2,
                                           loops={"single_turn": SingleTurnLoop}))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def rollout(worker, prompts, n: int, max_new_tokens: int, seed: int):
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, max_response_tokens=max_new_tokens)
    trajectories = asyncio.run(worker.rollout([(i, ids, {}) for i, ids in prompts], "single_turn", n, sampling, seed))
    return trajectories.unpack(dict(prompts))


@pytest.mark.quick
def test_one_request_per_sample_samples_what_a_batch_generate_samples(worker, tokenizer):
    """The single-turn loop submits one request per trajectory; the engine serves them request by
    request. A step of them samples exactly what vLLM's offline `generate` samples for the same
    prompts with n samples each and the same seeds: the same tokens, the same log-probs."""
    from vllm import SamplingParams, TokensPrompt

    prompts = [(i, tokenizer(f"{i}+{2 * i}=")["input_ids"]) for i in range(16)]
    served = rollout(worker, prompts, n=4, max_new_tokens=8, seed=11)
    batch = worker.llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in prompts],
                                [SamplingParams(n=4, temperature=1.0, max_tokens=8, detokenize=False, logprobs=0,
                                                flat_logprobs=True, seed=11 * 1_000_003 + i) for i, _ in prompts],
                                use_tqdm=False)
    expected = [c for output in batch for c in output.outputs]
    assert [t.response_ids for t in served] == [list(c.token_ids) for c in expected]
    for trajectory, completion in zip(served, expected):
        assert trajectory.logprobs == pytest.approx(list(completion.logprobs.logprobs), abs=1e-6)
        assert trajectory.response_mask == [1] * len(trajectory.response_ids)
    assert len({tuple(t.response_ids) for t in served}) > 8  # the seeds differ by prompt and sample


@pytest.mark.quick
def test_a_step_of_long_prompts_samples_each_prompt_as_it_would_alone(worker, tokenizer):
    """24 prompts of 200 tokens overflow vLLM's 4,096-token pass: on CPU a prompt split across
    passes crashed seeded sampling. Each prompt's samples depend on its seed only, not on the
    batch it came in, and their text is their tokens decoded."""
    prompts = [(i, tokenizer(f"{i:02d}+{i:02d}=" * 40)["input_ids"][:200]) for i in range(24)]
    assert {len(ids) for _, ids in prompts} == {200}

    together = rollout(worker, prompts, n=2, max_new_tokens=6, seed=3)
    alone = rollout(worker, prompts[17:18], n=2, max_new_tokens=6, seed=3)

    assert len(together) == 48 and all(t.response_ids for t in together)
    mine = [t for t in together if t.prompt_index == 17]
    assert [t.response_ids for t in mine] == [t.response_ids for t in alone]
    for a, b in zip(mine, alone):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert [t.text for t in together] == [tokenizer.decode(t.response_ids, skip_special_tokens=True)
                                          for t in together]


@pytest.mark.quick
def test_a_released_engine_fails_what_is_in_flight_and_the_next_samples_alike(worker, tokenizer, tiny_model_dir):
    """What a kept engine does between groups (`kept_actors`): released while responses are being
    sampled, it fails them (`EngineClosed`) and its serving ends before its vLLM engine shuts down;
    the engine built again in the process samples what the first one sampled, and a request to the
    released one is refused."""
    from rlsys.actors.rollout_worker import RolloutWorkerSpec
    from rlsys.rollout.request_engine import EngineClosed

    prompts = [(i, tokenizer(f"{i}+{i}=")["input_ids"]) for i in range(4)]
    before = rollout(worker, prompts, n=2, max_new_tokens=8, seed=5)
    released = worker.engine
    long = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=64, max_response_tokens=64)

    async def release_mid_response():
        flight = asyncio.ensure_future(worker.rollout([(i, ids, {}) for i, ids in prompts], "single_turn", 2,
                                                      long, 5))
        stepped = released.step_s
        while released.step_s == stepped:  # the engine has sampled a token of them
            await asyncio.sleep(0)
        assert released.busy
        kept = await worker.release()
        return kept, (await asyncio.gather(flight, return_exceptions=True))[0]

    kept, in_flight = asyncio.run(release_mid_response())
    assert kept and isinstance(in_flight, EngineClosed), in_flight
    with pytest.raises(EngineClosed):
        asyncio.run(released.generate(prompts[0][1], None))
    worker.reuse(None, RolloutWorkerSpec(tiny_model_dir, RolloutConfig(engine_memory_gib=0.1), seed=0, num_threads=2,
                                         loops={"single_turn": SingleTurnLoop}))
    after = rollout(worker, prompts, n=2, max_new_tokens=8, seed=5)
    assert [t.response_ids for t in after] == [t.response_ids for t in before]
    assert [t.logprobs for t in after] == [t.logprobs for t in before]


@pytest.mark.quick
def test_a_request_the_engine_refuses_fails_its_sample_alone(worker, tokenizer):
    """A prompt longer than the engine's max_model_len, rolled out beside others: its samples are left
    out (`dropped: rejected`, empty) and the others sample what they sample without it."""
    prompts = [(i, tokenizer(f"{i}+{2 * i}=")["input_ids"]) for i in range(3)]
    too_long = (3, prompts[0][1] * (worker.engine.max_model_len // len(prompts[0][1]) + 1))
    alone = rollout(worker, prompts, n=2, max_new_tokens=6, seed=5)
    beside = rollout(worker, [*prompts[:2], too_long, prompts[2]], n=2, max_new_tokens=6, seed=5)
    refused = [t for t in beside if t.dropped]
    assert [t.prompt_index for t in refused] == [3, 3] and {t.dropped for t in refused} == {"rejected"}
    assert all(t.response_ids == [] for t in refused)
    assert [t.response_ids for t in beside if not t.dropped] == [t.response_ids for t in alone]


def test_greedy_samples_of_one_prompt_are_each_served(worker, tokenizer):
    """Samples of one prompt at temperature 0 with consecutive seeds (a group sampled greedily, or two
    samples whose rewritten histories ask the same greedy summary) go to vLLM one request each: it
    refuses a greedy request of more than one sample, which would drop both."""
    prompts = [(0, tokenizer("3+4=")["input_ids"])]
    greedy = Sampling(temperature=0.0, top_p=1.0, max_new_tokens=6, max_response_tokens=6)
    trajectories = asyncio.run(worker.rollout([(0, prompts[0][1], {})], "single_turn", 2, greedy, 5)).unpack(
        dict(prompts))
    assert [t.dropped for t in trajectories] == [trajectories[0].dropped] * 2 and not trajectories[0].dropped
    assert trajectories[0].response_ids and trajectories[0].response_ids == trajectories[1].response_ids
