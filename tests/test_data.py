"""Tokenizer, data formats, malformed rows, and the SFT loss mask."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsys.algorithms.lm_loss import logprobs_of_labels, masked_nll_sum
from rlsys.config.training import DataConfig
from rlsys.data.batching import (
    EpochSampler,
    collate,
    collate_rollouts,
    cut_rows,
    micro_batches,
    split_rows,
    split_to_count,
    token_budget_sizes,
)
from rlsys.data.examples import load_pretrain_examples, load_sft_examples, sft_example
from rlsys.data.files import DataError
from rlsys.data.rl import load_prompts, prompt_budget
from rlsys.rewards import get_reward
from rlsys.tasks.arith import ArithSpec, split_problems

pytestmark = pytest.mark.quick  # the quick tier (scripts/test.sh --quick)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" if not isinstance(r, str) else r + "\n" for r in rows))
    return str(path)


def test_tokenizer_is_character_level_and_round_trips(tokenizer):
    text = "12+7=19\n 0-3=-3\tA,b!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_sft_mask_covers_response_and_end_token_only(tokenizer):
    row = {"prompt": [{"role": "user", "content": "12+7="}], "response": "19"}
    example = sft_example(row, DataConfig(), tokenizer)
    targets = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    assert tokenizer.decode(targets) == "19<|end|>"
    assert tokenizer.decode(example.input_ids) == "<|user|>12+7=<|end|><|assistant|>19<|end|>"


def test_plain_string_prompt_and_multi_turn_messages(tokenizer):
    plain = sft_example({"prompt": "Q: 1+1=", "response": "2"}, DataConfig(), tokenizer)
    assert tokenizer.decode([t for t, m in zip(plain.input_ids, plain.loss_mask) if m]) == "2<|end|>"
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="},
                         {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="},
                         {"role": "assistant", "content": "4"}]}
    example = sft_example(chat, DataConfig(), tokenizer)
    assert tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m]) == "2<|end|>4<|end|>"


def test_sft_loss_ignores_prompt_token_labels(tiny_model_dir, tokenizer):
    """Changing the label of a prompt token leaves the loss and its gradient
    unchanged; changing a response label does not (so the check can fail)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    example = sft_example({"prompt": [{"role": "user", "content": "12+7="}], "response": "19"},
                          DataConfig(), tokenizer)
    batch = collate([example], tokenizer.pad_token_id)

    def loss_and_grad(labels):
        model.zero_grad()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = masked_nll_sum(logprobs_of_labels(logits, labels), batch["loss_mask"])
        loss.backward()
        return loss.item(), model.model.embed_tokens.weight.grad.clone()

    labels = batch["input_ids"].clone()
    base_loss, base_grad = loss_and_grad(labels)
    prompt_positions = (batch["loss_mask"][0] == 0).nonzero().flatten()[1:]
    response_position = int(batch["loss_mask"][0].nonzero()[0])
    changed_prompt = labels.clone()
    changed_prompt[0, prompt_positions] = (labels[0, prompt_positions] + 7) % 100
    loss, grad = loss_and_grad(changed_prompt)
    assert loss == base_loss and torch.equal(grad, base_grad)
    changed_response = labels.clone()
    changed_response[0, response_position] = (labels[0, response_position] + 7) % 100
    assert loss_and_grad(changed_response)[0] != pytest.approx(base_loss)


def test_pretrain_packing_uses_every_token(tmp_path, tokenizer):
    docs = [{"text": "1+1=2"}, {"text": "22+3=25\n4-9=-5"}] * 10
    cfg = DataConfig(train_files=[write_jsonl(tmp_path / "p.jsonl", docs)], max_seq_len=8)
    examples, stats = load_pretrain_examples(cfg, tokenizer)
    stream_len = sum(len(d["text"]) + 1 for d in docs)
    assert len(examples) == stream_len // 8 and stats.kept == 20
    assert all(len(e.input_ids) == 8 and all(e.loss_mask) for e in examples)


def test_malformed_rows_are_skipped_and_counted(tmp_path, tokenizer):
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "2+2="}, {"prompt": 5, "response": "x"},
            {"prompt": [{"role": "user"}], "response": "4"}, {"prompt": "3+3=", "response": "6"}]
    cfg = DataConfig(train_files=[write_jsonl(tmp_path / "s.jsonl", rows)], max_seq_len=32)
    examples, stats = load_sft_examples(cfg, tokenizer)
    assert (len(examples), stats.kept, stats.skipped) == (2, 2, 3)
    assert stats.first_reason.startswith(f"{tmp_path / 's.jsonl'} row 2:")


def test_invalid_json_names_file_and_row(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "broken.jsonl", [{"prompt": "1+1=", "response": "2"}, "{not json", {"a": 1}])
    with pytest.raises(DataError, match=r"broken\.jsonl row 2: not valid JSON"):
        load_sft_examples(DataConfig(train_files=[path]), tokenizer)


def test_verl_schema_prompts_and_arith_reward(arith_files, tokenizer):
    prompts, stats = load_prompts([arith_files["test"]], tokenizer)
    assert stats.skipped == 0 and len(prompts) == 40
    first = prompts[0]
    assert first.text.startswith("<|user|>") and first.text.endswith("<|assistant|>")
    reward = get_reward("arith")
    assert reward(first.data_source, f" {first.ground_truth}\n", first.ground_truth) == 1.0
    assert reward(first.data_source, first.ground_truth + "0", first.ground_truth) == 0.0
    assert reward(first.data_source, "", first.ground_truth) == 0.0


def test_prompts_too_long_for_the_models_context_are_skipped_and_counted(tmp_path, tokenizer, tiny_model_dir):
    """The tiny model's context is 256 tokens: a 250-token prompt leaves no room for 16 new ones
    (vLLM would cut its response to 6) and a 300-token one failed the whole rollout."""
    rows = [{"prompt": text, "reward_model": {"ground_truth": "2"}, "data_source": "arith"}
            for text in ("1+1=", "1" * 250, "2+0=", "1" * 300)]
    path = write_jsonl(tmp_path / "rl.jsonl", rows)
    prompts, stats = load_prompts([path], tokenizer, prompt_budget(tiny_model_dir, response_tokens=16))
    assert [p.text for p in prompts] == ["1+1=", "2+0="] and (stats.kept, stats.skipped) == (2, 2)
    assert stats.first_reason == f"{path} row 2: prompt of 250 tokens, over the 240 that leave room for the response " \
                                 "in the model's context"
    assert prompts[0].ids == tokenizer("1+1=", add_special_tokens=False)["input_ids"]


def test_arith_test_split_is_held_out():
    train, test = split_problems(ArithSpec(max_operand=19, num_test=40))
    assert not set(train) & set(test) and len(test) == 40


def test_a_careless_teachers_sft_answers_drop_that_share_of_minus_signs_and_nothing_else(tmp_path):
    """ArithSpec.sign_slips: the careless SFT file's negative answers lose their sign at that rate; every
    other answer, the right SFT file, the pretraining corpus and the RL and test files' ground truths
    stay right."""
    import json

    import pandas as pd

    from rlsys.tasks.arith import write_splits

    spec = ArithSpec(max_operand=19, num_test=40, sign_slips=0.75, pretrain_passes=1)
    files = write_splits(str(tmp_path), spec)
    train, _ = split_problems(spec)
    taught = [json.loads(line)["response"] for line in open(files["sft_careless"])]
    assert [json.loads(line)["response"] for line in open(files["sft"])] == [p.answer for p in train]
    negative = [(p, answer) for p, answer in zip(train, taught) if p.answer.startswith("-")]
    assert all(answer == p.answer for p, answer in zip(train, taught) if not p.answer.startswith("-"))
    assert all(answer in (p.answer, p.answer[1:]) for p, answer in negative)
    slipped = sum(answer != p.answer for p, answer in negative) / len(negative)
    assert 0.65 < slipped < 0.85, slipped  # 179 negative answers, each slipping with probability 0.75 (seeded)
    truths = pd.read_parquet(files["rl_train"])["reward_model"].map(lambda r: r["ground_truth"]).tolist()
    assert truths == [p.answer for p in train]
    corpus = "\n".join(json.loads(line)["text"] for line in open(files["pretrain"]))
    assert all(f"{p.question}{p.answer}" in corpus for p, _ in negative)


def test_sampler_resumes_the_same_order():
    straight = EpochSampler(10, 4, seed=3)
    order = [straight.next_indices() for _ in range(6)]
    resumed = EpochSampler(10, 4, seed=3)
    [resumed.next_indices() for _ in range(2)]
    state = resumed.state_dict()
    fresh = EpochSampler(10, 4, seed=3)
    fresh.load_state_dict(state)
    assert [fresh.next_indices() for _ in range(4)] == order[2:]
    assert sorted(order[0] + order[1]) == sorted(set(order[0] + order[1]))  # no repeats within an epoch


def test_collate_right_pads_each_row_with_its_own_masks():
    from rlsys.data.examples import Example

    batch = collate([Example([5, 6, 7], [0, 1, 1]), Example([8], [1]), Example([9, 10], [0, 0])], pad_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2], [9, 10, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert (batch["input_ids"].dtype, batch["attention_mask"].dtype, batch["loss_mask"].dtype) == \
        (torch.long, torch.long, torch.float32)


def test_split_and_micro_batches_trim_padding(tokenizer):
    rows = [sft_example({"prompt": "1+1=", "response": "2" * n}, DataConfig(), tokenizer) for n in (1, 5, 2, 9)]
    batch = collate(rows, tokenizer.pad_token_id)
    shards = split_rows(batch, 2)
    assert [s["input_ids"].shape[0] for s in shards] == [2, 2]
    micro = micro_batches(shards[0], 1)
    assert [m["input_ids"].shape[1] for m in micro] == [len(rows[0].input_ids), len(rows[1].input_ids)]


def test_token_budget_cuts_consecutive_rows_and_splits_the_heaviest():
    lengths = [4, 4, 4, 9, 3, 3, 1]
    sizes = token_budget_sizes(lengths, 8)
    assert sizes == [2, 1, 1, 3]  # 4 + 4 | 4 | 9 alone, over the budget | 3 + 3 + 1
    assert split_to_count(sizes, lengths, 5) == [1, 1, 1, 1, 3]  # the heaviest, 4 + 4, halved first
    assert split_to_count(sizes, lengths, 6) == [1, 1, 1, 1, 1, 2]
    assert split_to_count(sizes, lengths, 9) == [1] * 7  # no more than a row each
    rows = collate_rollouts([[5] * n for n in lengths], [[6]] * len(lengths), pad_id=0)
    chunks = cut_rows(rows, [2, 1, 4])
    assert [tuple(c["input_ids"].shape) for c in chunks] == [(2, 5), (1, 5), (4, 10)]


def test_packed_rows_give_each_sequence_its_own_log_probs(tiny_model_dir):
    """Rows of 2 to 12 tokens packed end to end: fewer rows, every token's position and log-prob
    as in its own padded row (attending span by span), and no label across two sequences is a target."""
    from rlsys.data.packing import pack_rows
    from rlsys.parallel.span_attention import SharedPrefixSpans, apply_span_attention, span_inputs

    generator = torch.Generator().manual_seed(0)
    lengths = [12, 3, 7, 2, 9, 5, 4, 11]
    ids = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in lengths]
    batch = collate_rollouts([seq[:2] for seq in ids], [seq[2:] for seq in ids], pad_id=0)
    packing = pack_rows(batch)
    packed = packing.batch
    assert packed["input_ids"].shape == (5, 12)  # 53 tokens fit no fewer rows of 12 than 5
    assert int(packed["attention_mask"].sum()) == sum(lengths)
    assert int(packed["loss_mask"][:, 1:].sum()) == int(batch["loss_mask"][:, 1:].sum())

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    apply_span_attention(model)
    spans = SharedPrefixSpans.of(packed["segment_ids"], packed["prefix_ids"])
    with torch.no_grad():
        whole = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        expected = torch.nn.functional.pad(logprobs_of_labels(whole, batch["input_ids"]), (1, 0))
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                       **span_inputs(spans, *packed["segment_ids"].shape)).logits
        got = packing.unpack(torch.nn.functional.pad(logprobs_of_labels(logits, packed["input_ids"]), (1, 0)))
    real = batch["attention_mask"].bool()
    real[:, 0] = False
    assert torch.allclose(got[real], expected[real], atol=1e-5)
    assert (got[~real] == 0).all()


def test_every_group_that_repeats_a_prompt_shares_it():
    """8 samples of a 30-token prompt with 3-token answers share it (one row of 29 + 8 x 4 columns),
    as do 2 samples of a 2-token prompt; a one-token prompt, or a prompt no other row repeats, is
    not shared, nor are prompts whose groups would widen the rows into more cells than unshared."""
    from rlsys.data.packing import pack_rows

    for prompt, samples, answer, shared in [(30, 8, 3, True), (2, 2, 5, True), (1, 4, 3, False), (12, 1, 3, False)]:
        batch = collate_rollouts([list(range(3, 3 + prompt))] * samples, [[7] * answer] * samples, pad_id=0)
        packing = pack_rows(batch)
        assert bool(packing.batch["prefix_ids"].any()) == shared
        tokens = int(packing.batch["attention_mask"].sum())
        assert tokens == samples * (prompt + answer) - (samples - 1) * (prompt - 1) * shared
    # groups of 8, 4 and 4 answers of 10 tokens to 2-token prompts: shared, 179 tokens in rows as wide as the
    # widest group (89), 3 of them (267 cells); unshared, 16 rows of 12 (192 cells): not shared
    batch = collate_rollouts([[3 + g, 50] for g, size in enumerate((8, 4, 4)) for _ in range(size)],
                             [[7] * 10] * 16, pad_id=0)
    packed = pack_rows(batch).batch
    assert packed["input_ids"].shape == (16, 12) and not packed["prefix_ids"].any()


def flash_varlen_reference(query, key, value, query_offsets, key_offsets, longest_queries, longest_keys, *,
                           scale=None, window_size=(-1, -1), enable_gqa=False, top_left=False):
    """Flash attention's variable-length kernel as its documentation states it, on CPU: sequence i's
    queries (query_offsets[i]:query_offsets[i + 1]) attend its keys; causal (window (-1, 0)) with the
    diagonal ending at the last key, so queries shorter than their keys see every earlier key (or,
    `top_left`, as SDPA's `is_causal` aligns it: a kernel span attention must not be given)."""
    assert window_size == (-1, 0) and query_offsets.dtype == key_offsets.dtype == torch.int32
    lengths, key_lengths = query_offsets.diff(), key_offsets.diff()
    assert (longest_queries, longest_keys) == (int(lengths.max()), int(key_lengths.max()))
    outs = []
    for i in range(len(lengths)):
        q, k, v = (x[offsets[i]:offsets[i + 1]].transpose(0, 1) for x, offsets in
                   ((query, query_offsets), (key, key_offsets), (value, key_offsets)))
        shift = 0 if top_left else k.shape[1] - q.shape[1]
        sees = torch.arange(k.shape[1])[None] <= torch.arange(q.shape[1])[:, None] + shift
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=sees, scale=scale, enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(outs)


def packed_layout(rows: list[list[tuple[int, int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """segment_ids and prefix_ids of packed rows, each a list of spans (length, the 1-based index
    of the span it continues, 0 for none), right-padded to the widest row."""
    width = max(sum(length for length, _ in row) for row in rows)
    segments, prefixes = (torch.zeros(len(rows), width, dtype=torch.long) for _ in range(2))
    segment = 0
    for r, row in enumerate(rows):
        column = 0
        for length, continues in row:
            segment += 1
            segments[r, column:column + length], prefixes[r, column:column + length] = segment, continues
            column += length
    return segments, prefixes


LAYOUTS = {
    # row 0: a prompt (span 1), a 10-token and a 2-token answer to it; row 1: a lone sequence, then a
    # prompt and its 3-token answer
    "short": [[(4, 0), (10, 1), (2, 1)], [(9, 0), (4, 0), (3, 5)]],
    # lone spans of 3-200 tokens and answers of 2-150 tokens to prompts of 20 and 90: several batches
    "several batches": [[(20, 0), (50, 1), (3, 1), (60, 1)], [(200, 0), (5, 0)], [(90, 0), (150, 7), (40, 7)],
                        [(120, 0), (3, 0), (40, 0), (2, 0)]],
    # a tree: a system prompt (span 1), two prompts continuing it (2, 5), answers to each (3, 4; 6) and
    # a row that parts from the system prompt (7); then a lone sequence
    "tree": [[(5, 0), (4, 1), (3, 2), (2, 2), (6, 1), (30, 5), (2, 1)], [(40, 0)]],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kernel", ["sdpa", "varlen", "varlen top-left"])
def test_span_attention_is_attention_under_the_block_causal_mask(kernel, layout, monkeypatch):
    """Spans of any lengths in any order, the packed rows' last span shorter than the longest
    response (whose keys the shorter ones are padded to): each token's attention output is the
    dense block-causal mask's, with grouped key/value heads, by batches of like spans through SDPA
    and all at once through a variable-length kernel (a GPU's flash kernel; here its reference).
    A kernel whose causal diagonal starts at the first key (SDPA's) gives other outputs."""
    from functools import partial

    from rlsys.data.packing import block_causal_mask
    from rlsys.parallel import span_attention
    from rlsys.parallel.span_attention import SharedPrefixSpans, attend_spans

    calls = []
    if kernel != "sdpa":
        reference = partial(flash_varlen_reference, top_left=kernel.endswith("top-left"))
        monkeypatch.setattr(span_attention, "varlen_kernel", lambda query: calls.append(query) or reference)
    segments, prefixes = packed_layout(LAYOUTS[layout])
    spans = SharedPrefixSpans.of(segments, prefixes)
    assert len(spans.batches) >= (4 if layout == "several batches" else 2)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(segments.shape[0], 4, segments.shape[1], 8, generator=generator)
    key, value = (torch.randn(segments.shape[0], 2, segments.shape[1], 8, generator=generator) for _ in range(2))
    got = attend_spans(torch.nn.Module(), query, key, value, spans)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=block_causal_mask(segments, prefixes), enable_gqa=True).transpose(1, 2)
    real = segments > 0
    gap = (got - expected)[real].abs().max() / expected[real].abs().max()  # float32: a few ulps apart
    assert gap > 1e-2 if kernel.endswith("top-left") else gap < 1e-6
    assert len(calls) == (kernel != "sdpa")


def sequence_positions(segments: torch.Tensor, prefixes: torch.Tensor) -> torch.Tensor:
    """Each packed token's position in its sequence: its ancestors' tokens, then its index in its span."""
    from rlsys.data.packing import span_ancestors

    chains = span_ancestors(segments, prefixes)
    lengths = torch.bincount(segments.flatten(), minlength=len(chains))
    starts = torch.tensor([int(lengths[chain].sum()) if chain else 0 for chain in chains])
    first_column = {}
    positions = torch.zeros_like(segments)
    for r, c in torch.nonzero(segments > 0).tolist():
        segment = int(segments[r, c])
        first_column.setdefault(segment, c)
        positions[r, c] = starts[segment] + c - first_column[segment]
    return positions


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("window", [1, 4, 37])
def test_a_sliding_window_layer_attends_by_spans_within_its_window(window, layout, monkeypatch):
    """A sliding-window layer's spans: each token's attention output is that of the dense
    block-causal mask narrowed to the keys fewer than `window` positions before it in its sequence
    (its ancestors' included), through SDPA even where a variable-length kernel would run, but
    where the window holds every span's keys (37 tokens, the short layout's): full attention."""
    from rlsys.data.packing import block_causal_mask
    from rlsys.parallel import span_attention
    from rlsys.parallel.span_attention import SharedPrefixSpans, attend_spans

    asked = []
    monkeypatch.setattr(span_attention, "varlen_kernel", lambda query: asked.append(query))  # None: SDPA
    segments, prefixes = packed_layout(LAYOUTS[layout])
    spans = SharedPrefixSpans.of(segments, prefixes)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(segments.shape[0], 4, segments.shape[1], 8, generator=generator)
    key, value = (torch.randn(segments.shape[0], 2, segments.shape[1], 8, generator=generator) for _ in range(2))
    got = attend_spans(torch.nn.Module(), query, key, value, spans, window=window)
    whole = window >= spans.longest_keys
    assert bool(asked) == whole  # a variable-length kernel is asked for no window
    positions = sequence_positions(segments, prefixes)
    near = (positions[:, :, None] - positions[:, None, :] < window)[:, None]
    mask = block_causal_mask(segments, prefixes) & (near | torch.eye(segments.shape[1], dtype=torch.bool))
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                                enable_gqa=True).transpose(1, 2)
    real = segments > 0
    assert (got - expected)[real].abs().max() < 1e-6
    unwindowed = attend_spans(torch.nn.Module(), query, key, value, spans)
    assert ((unwindowed - expected)[real].abs().max() < 1e-6) == whole


def test_a_sliding_window_layer_masks_grow_with_the_rows_length_not_its_square():
    """Rows of 4,000 and 1,000 tokens under an 8-token window: the masks cover each tile of queries and
    the keys its window reaches (at most a tile plus the window a query), not the rows' width, and the
    output is causal attention within the window."""
    from rlsys.parallel.span_attention import WINDOW_TILE, SharedPrefixSpans, attend_spans

    mask = torch.zeros(2, 4000, dtype=torch.long)
    mask[0], mask[1, :1000] = 1, 1
    spans = SharedPrefixSpans.of_rows(mask)
    window = 8
    cells = sum(m.numel() for m in spans.windowed(window).windowed_masks(window))
    assert cells <= 5000 * (WINDOW_TILE + window)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 2, 4000, 8, generator=generator) for _ in range(3))
    got = attend_spans(torch.nn.Module(), query, key, value, spans, window=window)
    position = torch.arange(4000)
    near = (position[:, None] - position[None, :] < window) & (position[None, :] <= position[:, None])
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=near).transpose(1, 2)
    assert (got[0] - expected[0]).abs().max() < 1e-5 and (got[1, :1000] - expected[1, :1000]).abs().max() < 1e-5


def test_unpacked_rows_attend_a_span_a_row():
    """Right-padded rows (one of them empty), each its own span: causal attention over each row's
    tokens, as SDPA's causal attention gives them."""
    from rlsys.parallel.span_attention import SharedPrefixSpans, attend_spans

    mask = torch.tensor([[1] * 7 + [0] * 2, [0] * 9, [1] * 9, [1] * 3 + [0] * 6])
    spans = SharedPrefixSpans.of_rows(mask)
    assert spans.lengths.tolist() == [7, 9, 3]
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(4, 2, 9, 8, generator=generator) for _ in range(3))
    got = attend_spans(torch.nn.Module(), query, key, value, spans)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True).transpose(1, 2)
    assert (got - expected)[mask.bool()].abs().max() < 1e-6


def test_the_flash_kernel_is_called_as_the_installed_pytorch_takes_it(monkeypatch):
    """`flash_varlen`'s call binds to this PyTorch's `varlen_attn` (its keywords changed between
    releases); on a CPU tensor no variable-length kernel is chosen."""
    import inspect

    from torch.nn.attention import varlen

    from rlsys.parallel.span_attention import flash_varlen, varlen_kernel

    signature, bound = inspect.signature(varlen.varlen_attn), []

    def recording(*args, **kwargs):
        bound.append(signature.bind(*args, **kwargs))

    recording.__signature__ = signature  # what flash_varlen reads the keywords from
    monkeypatch.setattr(varlen, "varlen_attn", recording)
    offsets = torch.tensor([0, 3], dtype=torch.int32)
    flash_varlen(torch.ones(3, 4, 8), torch.ones(3, 2, 8), torch.ones(3, 2, 8), offsets, offsets, 3, 3, scale=0.5,
                 enable_gqa=True)
    assert bound and varlen_kernel(torch.zeros(3, 4, 8)) is None

    def first_release(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        bound.append((query, key, is_causal))  # torch 2.9's: no scale, window or grouped heads

    monkeypatch.setattr(varlen, "varlen_attn", first_release)
    flash_varlen(torch.ones(3, 4, 8), torch.ones(3, 2, 8), torch.ones(3, 2, 8), offsets, offsets, 3, 3, scale=0.5,
                 enable_gqa=True)
    query, key, is_causal = bound[-1]
    assert is_causal and key.shape == (3, 4, 8) and query[0, 0, 0] == pytest.approx(0.5 * 8 ** 0.5)


@pytest.mark.parametrize("model", ["tiny_model_dir", "windowed_model_dir"])
def test_attention_by_spans_builds_no_dense_mask(model, request, monkeypatch):
    """A packed row attended by spans makes transformers build no [rows, 1, W, W] mask from its
    positions, for full and sliding-window layers alike; given no mask at all, it builds one a kind of
    layer (what `span_inputs`' unread view prevents)."""
    from transformers import masking_utils

    from rlsys.data.packing import pack_rows
    from rlsys.parallel.span_attention import SharedPrefixSpans, apply_span_attention, span_inputs

    built = []
    sdpa_mask = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def recording(*args, **kwargs):
        mask = sdpa_mask(*args, **kwargs)
        built.append(None if mask is None else tuple(mask.shape))
        return mask

    monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", recording)
    batch = collate_rollouts([[5, 6, 7, 8]] * 4, [[9, 10], [11], [12, 13, 14], [15]], pad_id=0)
    packed = pack_rows(batch).batch
    segments, prefixes = packed["segment_ids"], packed["prefix_ids"]
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model), dtype=torch.float32)
    apply_span_attention(model)
    spans = SharedPrefixSpans.of(segments, prefixes)
    with torch.no_grad():
        model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False,
              **span_inputs(spans, *segments.shape))
        assert built == []
        model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False,
              attention_mask=None, shared_spans=spans)
    kinds = len(set(model.config.layer_types))
    assert built == [(1, 1, segments.shape[1], segments.shape[1])] * kinds


def test_a_pipeline_stage_of_a_sliding_window_model_attends_by_spans(windowed_model_dir, monkeypatch):
    """A pipeline stage holding a sliding-window model's layers attends its rows a span each, each
    layer within its own window: the model's logits as transformers gives them, without a mask
    of the rows' width (which transformers builds for the sliding layer otherwise)."""
    from transformers import masking_utils

    from rlsys.parallel.pipeline_stages import split_into_stages
    from rlsys.parallel.span_attention import apply_span_attention

    load = lambda: AutoModelForCausalLM.from_pretrained(windowed_model_dir, dtype=torch.float32)  # noqa: E731
    ids = torch.randint(3, 100, (3, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = load()(input_ids=ids).logits
        [stage] = split_into_stages(load, pp=1, pp_rank=0, stages_per_rank=1)
        apply_span_attention(stage)
        built = []
        sdpa_mask = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
        monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa",
                            lambda *args, **kwargs: built.append(1) or sdpa_mask(*args, **kwargs))
        got = stage(ids)
    assert built == [] and (got - expected).abs().max() < 1e-5


def tree_batch(generator: torch.Generator) -> dict:
    """Rows whose contexts form a tree: a 5-token system prompt S; 3 samples of S + question A, 2 of
    S + question B; 2 rows whose context continues S + A by 4 tokens, 1 with context S alone; 2 rows
    beginning otherwise (one alone, one with a 1-token context: nothing to share)."""
    ids = lambda n: torch.randint(3, 100, (n,), generator=generator).tolist()  # noqa: E731
    system, question_a, question_b, history = ids(5), ids(4), ids(3), ids(4)
    contexts = [system + question_a] * 3 + [system + question_b] * 2 + [system + question_a + history] * 2 + \
        [system, ids(6), ids(1)]
    return collate_rollouts(contexts, [ids(1 + i % 4) for i in range(len(contexts))], pad_id=0)


def test_contexts_that_begin_alike_are_packed_once_as_a_tree():
    """The tree of `tree_batch`: S once, A's and B's questions once past it, the longer history once past
    A, every row's own tokens from the last token it shares; each span's tokens stand for the rows below it."""
    from rlsys.data.packing import pack_rows, rows_per_span, span_ancestors

    batch = tree_batch(torch.Generator().manual_seed(2))
    packing = pack_rows(batch)
    packed = packing.batch
    lengths = batch["attention_mask"].sum(1)
    # 104 tokens in rows; packed: S's first 4, A's 4 and B's 3 past them (each node's first token repeats its
    # parent's last), the history's 4 past A, the rows' own 3 + 4 (history), 2 + 3 + 4 (A), 5 + 2 (B), 5 (S),
    # and the two rows alone, 7 + 3
    assert int(lengths.sum()) == 104 and int(packed["attention_mask"].sum()) == 4 + 4 + 3 + 4 + 7 + 9 + 7 + 5 + 10
    assert int(packed["loss_mask"][:, 1:].sum()) == int(batch["loss_mask"][:, 1:].sum())
    segments, prefixes = packed["segment_ids"], packed["prefix_ids"]
    depths = [len(chain) for chain in span_ancestors(segments, prefixes)[1:]]
    assert depths.count(3) == 2 and depths.count(0) == 3  # the history's rows under S, A and the history
    counts = rows_per_span(segments, prefixes)
    assert sorted(counts.tolist()[1:], reverse=True)[:4] == [8, 5, 2, 2]  # S, A, B, the history
    unshared = pack_rows(batch, share_prompts=False).batch
    assert not unshared["prefix_ids"].any() and int(unshared["attention_mask"].sum()) == int(lengths.sum())


def test_a_chain_of_contexts_hundreds_deep_packs():
    """600 rows, each context one token longer than the last's (an episode's segments, each repeating the
    one before as its history): a chain of 600 spans, each token of it laid out once, no recursion limit."""
    from rlsys.data.packing import pack_rows, span_ancestors

    rows = 600
    batch = collate_rollouts([list(range(3, 5 + row)) for row in range(rows)], [[2]] * rows, pad_id=0)
    packing = pack_rows(batch)
    packed = packing.batch
    # the root's first token, then one token a level, each row repeating its last context token and its answer
    assert int(packed["attention_mask"].sum()) == 1 + (rows - 1) + 2 * rows
    assert max(map(len, span_ancestors(packed["segment_ids"], packed["prefix_ids"]))) == rows - 1
    assert packing.reads[0].numel() == int(batch["attention_mask"].sum())


def test_shared_prompts_give_each_sample_its_own_log_probs_and_gradient(tiny_model_dir):
    """Two GRPO groups of 4 samples of a 6-token prompt, and two rows alone: each group's prompt
    is packed once, yet every token's log-prob and the gradient of a token-level loss are those
    of the padded rows, attending span by span (`rlsys.parallel.span_attention`)."""
    from rlsys.data.packing import pack_rows

    generator = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, 100, (n,), generator=generator).tolist()  # noqa: E731
    prompts = [ids(6), ids(6), ids(6), ids(3)]
    group_of = [0, 0, 0, 0, 1, 1, 1, 1, 2, 3]
    batch = collate_rollouts([prompts[g] for g in group_of], [ids(1 + i % 4) for i in range(10)], pad_id=0)
    packed = pack_rows(batch).batch
    assert int(packed["attention_mask"].sum()) == int(batch["attention_mask"].sum()) - 2 * 3 * 5
    assert pack_rows(batch, share_prompts=False).batch["attention_mask"].sum() == batch["attention_mask"].sum()
    assert_packed_pass_is_the_rows(tiny_model_dir, batch, generator)


@pytest.mark.parametrize("rows", ["tree", "episodes", "tree, Qwen2-MoE"])
def test_a_sliding_window_models_packed_rows_give_each_row_its_own_log_probs_and_gradient(windowed_model_dir, rows,
                                                                                          tmp_path):
    """A model whose second layer attends within 3 positions, on `tree_batch`'s and `episode_batch`'s rows
    packed as trees (their spans' ancestors longer than the window): every token's log-prob and the
    gradient of a token-level loss are the padded rows' under transformers' own sliding-window mask;
    so for a Qwen2-MoE, whose layers keep their window without passing it to the attention function."""
    from rlsys.models.tiny import TinyModelSpec, write_tiny_model

    model_dir = windowed_model_dir
    if rows.endswith("MoE"):
        spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=105, num_experts=4, moe_type="qwen2_moe",
                             sliding_window=3)
        model_dir = write_tiny_model(str(tmp_path / "moe"), spec)
    generator = torch.Generator().manual_seed(2)
    batch = episode_batch() if rows == "episodes" else tree_batch(generator)
    assert_packed_pass_is_the_rows(model_dir, batch, generator)


def test_a_tree_of_contexts_gives_each_row_its_own_log_probs_and_gradient(tiny_model_dir):
    """`tree_batch`'s rows packed as a tree, three spans deep: every token's log-prob and the gradient
    of a token-level loss are the padded rows'."""
    generator = torch.Generator().manual_seed(2)
    assert_packed_pass_is_the_rows(tiny_model_dir, tree_batch(generator), generator)


def rows_of_turns(rows: list[list[tuple[list[int], bool]]]) -> dict:
    """A right-padded batch of rows given as turns (tokens, trained or not)."""
    from rlsys.data.batching import Example, collate

    examples = [Example([t for tokens, _ in turns for t in tokens],
                        [int(trained) for tokens, trained in turns for _ in tokens]) for turns in rows]
    return collate(examples, pad_id=0)


def episode_batch() -> dict:
    """Two episodes of one prompt P under a harness that replaces a tool output with a note: each
    segment holds its call (trained in the first segment) as history; the first episode's third
    segment holds all of its second's (its answer, trained there). The two episodes' calls begin
    with the same two tokens, which both train. Then two rows where each trains what the other
    holds as history (t by X, u by Y)."""
    P, note = [3, 4, 5, 6, 7], [8, 9]
    call, call_b = [20, 21, 22, 23], [20, 21, 32, 33]
    A1 = [(P, False), (call, True), ([40, 41, 42], False), ([43, 44, 45], True)]
    B1 = [(P, False), (call, False), (note, False), ([50, 51, 52], True)]
    C1 = B1[:3] + [([50, 51, 52], False), ([53, 54, 55], False), ([56, 57], True)]
    A2 = [(P, False), (call_b, True), ([60, 61, 62], False), ([63, 64, 65], True)]
    B2 = [(P, False), (call_b, False), (note, False), ([70, 71, 72], True)]
    X = [([10, 11, 12], False), ([13, 14, 15], True), ([16, 17], False), ([18, 19], True)]
    Y = [([10, 11, 12], False), ([13, 14, 15], False), ([16, 17], True), ([24, 25], False)]
    return rows_of_turns([A1, B1, C1, A2, B2, X, Y])


def test_an_earlier_segments_trained_turns_are_laid_out_once_for_the_segments_that_repeat_them():
    """`episode_batch`: P once; the first episode's call once (trained, its first segment's) for its
    three segments, and its second segment's answer once for the third; the second episode's call
    apart from the first's past their common first token (both train it); X's t, which Y holds as
    history, once, and Y's u, which X holds, once: 77 + 20 tokens in rows, 44 + 13 laid out. Every
    trained token is a target once, with its own row's advantage."""
    from rlsys.data.packing import pack_rows

    batch = episode_batch()
    batch["advantages"] = torch.arange(1.0, 8.0)[:, None] * batch["loss_mask"]
    packed = pack_rows(batch).batch
    assert int(batch["attention_mask"].sum()) == 77 + 20
    # P's first 4 | call's 4 | A1's rest 7 | the note and B1's answer 5 | B1's last 1 | C1's rest 6 | A2's call 4 |
    # A2's rest 7 | B2's rest 6; X and Y: Q and t's first 2 | t's last and u's first | Y's rest 3 | X's rest 3
    assert int(packed["attention_mask"].sum()) == 44 + 13
    trained = lambda fields: sorted(zip(fields["input_ids"][fields["loss_mask"].bool()].tolist(),  # noqa: E731
                                        fields["advantages"][fields["loss_mask"].bool()].tolist()))
    assert trained(packed) == trained(batch)


def test_trained_turns_shared_as_history_give_each_row_its_own_log_probs_and_gradient(tiny_model_dir):
    """`episode_batch` packed as a tree whose nodes hold trained tokens: every token's log-prob and the
    gradient of a token-level loss (each row its own advantage) are the padded rows'."""
    assert_packed_pass_is_the_rows(tiny_model_dir, episode_batch(), torch.Generator().manual_seed(3))


def test_random_rows_that_begin_alike_pack_to_their_own_targets_and_reads():
    """Rows drawn from a 3-token alphabet, each beginning with one of two prompts, with random trained
    turns (so rows begin alike for long stretches, and train what others hold as history): every
    trained token is a target once, after what its row holds before it and with its row's
    advantage, and every token of every row is read from a packed copy that sees its row's tokens up
    to it (under the block-causal mask of the packed spans, in order of position)."""
    from rlsys.data.packing import block_causal_mask, pack_rows

    generator = torch.Generator().manual_seed(4)
    for _ in range(200):
        rows = []
        for _ in range(int(torch.randint(2, 9, (), generator=generator))):
            turns = [([3, 4, 5][:int(torch.randint(2, 4, (), generator=generator))], False)]
            for _ in range(int(torch.randint(1, 5, (), generator=generator))):
                tokens = (torch.randint(6, 9, (int(torch.randint(1, 4, (), generator=generator)),),
                                        generator=generator)).tolist()
                turns.append((tokens, bool(torch.rand((), generator=generator) < 0.5)))
            rows.append(turns)
        batch = rows_of_turns(rows)
        batch["advantages"] = torch.arange(1.0, len(rows) + 1)[:, None] * batch["loss_mask"]
        packing = pack_rows(batch)
        packed = packing.batch
        sees = block_causal_mask(packed["segment_ids"], packed["prefix_ids"])[:, 0]

        def seen(packed_row: int, column: int) -> list[int]:
            """The tokens the packed copy at (packed_row, column) sees, in order of position."""
            columns = torch.nonzero(sees[packed_row, column]).flatten()
            positions = packed["position_ids"][packed_row, columns]
            assert sorted(positions.tolist()) == list(range(len(columns)))
            return packed["input_ids"][packed_row, columns[positions.argsort()]].tolist()

        ids = [row[:int(length)] for row, length in zip(batch["input_ids"].tolist(), batch["attention_mask"].sum(1))]
        targets = [(tuple(seen(r, c - 1) + [int(packed["input_ids"][r, c])]), float(packed["advantages"][r, c]))
                   for r, c in torch.nonzero(packed["loss_mask"]).tolist()]
        expected = [(tuple(ids[r][:t + 1]), float(batch["advantages"][r, t]))
                    for r, t in torch.nonzero(batch["loss_mask"]).tolist() if t > 0]
        assert sorted(targets) == sorted(expected)
        reads = list(zip(*(index.tolist() for index in packing.reads)))
        assert sorted((r, t) for r, t, _, _ in reads) == [(r, t) for r in range(len(ids)) for t in range(len(ids[r]))]
        assert all(seen(packed_row, column) == ids[r][:t + 1] for r, t, packed_row, column in reads)


def assert_packed_pass_is_the_rows(tiny_model_dir: str, batch: dict, generator: torch.Generator) -> None:
    """A token-level loss over `batch` packed (sharing contexts) and attended by spans: each token's
    log-prob and the model's gradient within 1e-6 of the padded rows'; no target lost to packing."""
    from rlsys.data.packing import pack_rows
    from rlsys.parallel.span_attention import SharedPrefixSpans, apply_span_attention, span_inputs, uses_span_attention

    batch["advantages"] = torch.randn(batch["input_ids"].shape[0], 1, generator=generator) * batch["loss_mask"]
    packing = pack_rows(batch)
    packed = packing.batch
    assert bool(packed["prefix_ids"].any())
    assert int(packed["loss_mask"][:, 1:].sum()) == int(batch["loss_mask"][:, 1:].sum())

    def grads_and_logprobs(fields, spans: bool = False, **inputs):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if spans:
            apply_span_attention(model)
            assert uses_span_attention(model)
        logprobs = logprobs_of_labels(model(input_ids=fields["input_ids"], **inputs).logits, fields["input_ids"])
        (logprobs * (fields["loss_mask"] * fields["advantages"])[:, 1:]).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        return grads, torch.nn.functional.pad(logprobs.detach(), (1, 0))

    expected_grads, expected = grads_and_logprobs(batch, attention_mask=batch["attention_mask"])
    segments, prefixes = packed["segment_ids"], packed["prefix_ids"]
    grads, logprobs = grads_and_logprobs(packed, True, position_ids=packed["position_ids"],
                                         **span_inputs(SharedPrefixSpans.of(segments, prefixes), *segments.shape))
    got = packing.unpack(logprobs)
    real = batch["attention_mask"].bool()
    real[:, 0] = False
    assert (got[real] - expected[real]).abs().max() < 1e-6
    assert (grads - expected_grads).abs().max() < 1e-6 * expected_grads.abs().max()
