"""Vision-language models: tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL models written with
transformers (the character tokenizer with Qwen's vision tokens, the processor beside it). Prompts in VeRL's multimodal
schema (an `images` column, `<image>` in the prompt) reach the rollout engine with their pictures:
vLLM expands each image pad to the processor's count, and its log-probs of what it samples equal
transformers' given the same pixels (fp32); a picture that cannot be read skips its row, counted;
the eval stage runs the model; training it is refused in one line."""

from __future__ import annotations

import asyncio
import io
import pathlib

import pytest
import torch
from transformers import AutoTokenizer

from rlsys.actors.train_worker import TrainWorker
from rlsys.models.vision_compat import allow_qwen_vl_without_torchvision

# One xdist worker runs this module (scripts/test.sh): the vision-language models and data, built once.
pytestmark = pytest.mark.xdist_group("vision")

RL_CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "arith" / "rlvr.yaml")


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    """The directory of a tiny model of a family (`rlsys.models.tiny_vl.FAMILIES`), written once."""
    from rlsys.models.tiny_vl import TinyVLSpec, write_tiny_vl_model

    written = {}

    def dir_of(family: str) -> str:
        if family not in written:
            written[family] = write_tiny_vl_model(str(tmp_path_factory.mktemp(family)), TinyVLSpec(family=family))
        return written[family]

    return dir_of


@pytest.fixture(scope="module")
def tiny_vl_dir(vl_dirs) -> str:
    return vl_dirs("qwen2_vl")


def dots(count: int) -> bytes:
    """A 56 x 56 PNG of `count` black dots."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), "white")
    draw = ImageDraw.Draw(image)
    for i in range(count):
        x, y = 4 + 16 * (i % 3), 4 + 16 * (i // 3)
        draw.ellipse([x, y, x + 12, y + 12], fill="black")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def dots_file(tmp_path_factory) -> str:
    """4 rows asking how many dots a picture holds (1 to 4), then a row whose picture is not an image,
    one with two <image> markers for its one picture, and one of 5 pictures (a prompt may hold 4)."""
    from datasets import Dataset

    def row(count: int, pictures: list[bytes], question: str = "<image>dots=") -> dict:
        return {"data_source": "arith", "prompt": [{"role": "user", "content": question}],
                "images": [{"bytes": picture, "path": None} for picture in pictures],
                "reward_model": {"ground_truth": str(count)}}

    rows = [row(count, [dots(count)]) for count in (1, 2, 3, 4)]
    rows += [row(1, [b"not a picture"]), row(1, [dots(1)], "<image><image>dots="), row(5, [dots(1)] * 5, "<image>" * 5)]
    path = str(tmp_path_factory.mktemp("dots") / "dots.parquet")
    Dataset.from_list(rows).to_parquet(path)
    return path


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_prompts_with_pictures_are_sampled_with_them_and_the_trainers_logprobs(vl_dirs, dots_file, family):
    """The rows' pictures go with their prompts through the single-turn loop to vLLM, one image pad
    each in the prompt's ids; transformers' log-probs of the sampled tokens, given the processor's
    pixels of the same picture, equal the engine's within 1e-4; another picture changes them."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlsys.actors.rollout_worker import RolloutWorker, RolloutWorkerSpec
    from rlsys.agents.loop import SingleTurnLoop
    from rlsys.agents.trajectory import Sampling
    from rlsys.config.rollout import RolloutConfig
    from rlsys.data.files import DataError
    from rlsys.data.image_tokens import image_expander_of
    from rlsys.data.rl import load_prompts

    tiny_vl_dir = vl_dirs(family)
    allow_qwen_vl_without_torchvision()
    processor = AutoProcessor.from_pretrained(tiny_vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir, dtype=torch.float32).eval()
    expander = image_expander_of(tiny_vl_dir)
    prompts, stats = load_prompts([dots_file], processor.tokenizer, expander=expander)
    assert len(prompts) == 4 and stats.skipped == 3
    expanded = len(prompts[0].ids) + 3  # the context budget counts the pad as the engine expands it: 4 tokens
    assert len(load_prompts([dots_file], processor.tokenizer, expanded, expander=expander)[0]) == 4
    with pytest.raises(DataError, match=f"prompt of {expanded} tokens, over the {expanded - 1}"):
        load_prompts([dots_file], processor.tokenizer, expanded - 1, expander=expander)
    image_pad = model.config.image_token_id
    assert all(p.ids.count(image_pad) == 1 and len(p.images) == 1 for p in prompts)

    worker = RolloutWorker(RolloutWorkerSpec(tiny_vl_dir, RolloutConfig(engine_memory_gib=0.1), seed=0, num_threads=2,
                                             loops={"single_turn": SingleTurnLoop}))
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=8, max_response_tokens=8)
    trajectories = asyncio.run(worker.rollout([(i, p.ids, p.row) for i, p in enumerate(prompts)], "single_turn", 1,
                                              sampling, seed=3)).unpack({i: p.ids for i, p in enumerate(prompts)})
    next_token = []
    for prompt, trajectory in zip(prompts, trajectories):
        inputs = processor(text=[prompt.text], images=prompt.images, return_tensors="pt")
        expanded = inputs["input_ids"][0].tolist()
        merge = processor.image_processor.merge_size
        assert expanded.count(image_pad) == int(inputs["image_grid_thw"].prod()) // merge**2 == 4
        sampled = trajectory.response_ids
        ids = torch.tensor([expanded + sampled])
        kinds = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(sampled), dtype=torch.long)], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                           mm_token_type_ids=kinds).logits[0]
        logprobs = torch.log_softmax(logits, -1)[len(expanded) - 1:-1].gather(1, torch.tensor(sampled)[:, None])[:, 0]
        assert (logprobs - torch.tensor(trajectory.logprobs)).abs().max() < 1e-4
        next_token.append(torch.log_softmax(logits[len(expanded) - 1], -1))
    assert (next_token[0] - next_token[3]).abs().max() > 1e-2  # the picture matters


@pytest.fixture(scope="module")
def dots_sft_file(tmp_path_factory) -> str:
    """8 conversations: a picture of 1 to 4 dots and its count; the last two rows have no picture."""
    from datasets import Dataset

    def row(count: int, picture: bool = True) -> dict:
        question = "<image>dots=" if picture else "dots=1+1="
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": str(count)}],
                "images": [{"bytes": dots(count), "path": None}] if picture else []}

    rows = [row(count) for count in (1, 2, 3, 4, 2, 3)] + [row(2, picture=False), row(2, picture=False)]
    path = str(tmp_path_factory.mktemp("dots_sft") / "dots_sft.parquet")
    Dataset.from_list(rows).to_parquet(path)
    return path


def reference_inputs(tiny_vl_dir: str, rows: list[dict]) -> dict:
    """The processor's own inputs for `rows` (chat messages with <image> markers, pictures), right-padded."""
    from transformers import AutoProcessor

    from rlsys.data.images import load_images, with_image_parts

    allow_qwen_vl_without_torchvision()
    processor = AutoProcessor.from_pretrained(tiny_vl_dir)
    ids, kinds, pixels, grids = [], [], [], []
    for row in rows:
        images = load_images(row["images"]) if len(row["images"]) else None
        messages = with_image_parts(row["messages"], len(images or []))
        text = processor.tokenizer.apply_chat_template(messages, tokenize=False)
        inputs = processor(text=[text], images=images, return_tensors="pt")
        ids.append(inputs["input_ids"][0])
        kinds.append(inputs["mm_token_type_ids"][0])
        if images:
            pixels.append(inputs["pixel_values"])
            grids.append(inputs["image_grid_thw"])
    pad = lambda rows: torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # noqa: E731
    return {"input_ids": pad(ids), "mm_token_type_ids": pad(kinds), "pixel_values": torch.cat(pixels),
            "image_grid_thw": torch.cat(grids)}


FSDP2, TP2 = ["parallel.dp_shard=2"], ["parallel.dp_shard=1", "parallel.tp=2"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,layout", [("qwen2_vl", FSDP2), ("qwen2_vl", TP2), ("qwen2_5_vl", TP2),
                                           ("qwen3_vl", FSDP2), ("qwen3_vl", TP2)],
                         ids=["qwen2_vl-fsdp2", "qwen2_vl-tp2", "qwen2_5_vl-tp2", "qwen3_vl-fsdp2", "qwen3_vl-tp2"])
def test_sft_and_rl_gradients_on_two_ranks_equal_one_process(ray_cluster, sft_config, vl_dirs, dots_sft_file,
                                                             family, layout):
    """The processor's path: each picture's pad becomes the 4 image tokens the model expects, with its
    pixels. Loss, gradients (vision tower included) and log-probs of the SFT loss and of the RL policy loss
    on 2 FSDP2 ranks (one rank's second micro-batch has no picture), and on 2 tensor-parallel ranks (the
    language model split, the vision tower whole on each), equal transformers' in one process."""
    import pandas as pd
    from parity import ALGO, assert_gradients_match, layout_run, trained_gradients
    from transformers import AutoModelForImageTextToText

    from rlsys.algorithms.actor_loss import ActorInputs, actor_loss
    from rlsys.algorithms.lm_loss import logprobs_of_labels, nll_loss
    from rlsys.config.training import DataConfig
    from rlsys.data.batching import collate, num_targets
    from rlsys.data.examples import load_sft_examples, with_pixels
    from rlsys.data.image_tokens import image_expander_of

    tiny_vl_dir = vl_dirs(family)
    expander = image_expander_of(tiny_vl_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_dir)
    examples, stats = load_sft_examples(DataConfig(train_files=[dots_sft_file], max_seq_len=64), tokenizer,
                                        expander)
    assert len(examples) == 8 and stats.skipped == 0
    examples = with_pixels(examples, expander)
    sft = collate(examples, tokenizer.pad_token_id)
    reference = reference_inputs(tiny_vl_dir, pd.read_parquet(dots_sft_file).to_dict("records"))
    assert torch.equal(reference["input_ids"], sft["input_ids"] * sft["attention_mask"])
    assert (sft["input_ids"] == expander.image_token_id).sum(1).tolist() == [4] * 6 + [0, 0]

    generator = torch.Generator().manual_seed(0)
    rl = dict(sft, loss_mask=sft["loss_mask"], advantages=torch.randn(8, 1, generator=generator) * sft["loss_mask"])
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir, dtype=torch.float32)

    def forward():
        return model(input_ids=sft["input_ids"], attention_mask=sft["attention_mask"], **{
            k: v for k, v in reference.items() if k != "input_ids"}).logits

    with torch.no_grad():
        logprobs = torch.nn.functional.pad(logprobs_of_labels(forward(), sft["input_ids"]), (1, 0))
    noise = lambda: 0.05 * torch.randn(logprobs.shape, generator=generator)  # noqa: E731
    rl.update(old_logprobs=logprobs + noise(), ref_logprobs=logprobs + noise())
    counts = {"tokens": num_targets(rl), "sequences": 8}
    expected = []
    inputs = ActorInputs(old_logprobs=True, ref_logprobs=True)  # no teacher's top-k tokens
    rl_loss = actor_loss(counts, ALGO, inputs)
    for batch, loss_fn in ((sft, nll_loss(num_targets(sft))), (rl, rl_loss)):
        model.zero_grad()
        out = loss_fn(forward(), batch)
        out.loss.backward()
        expected.append((out.loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}))

    text = collate([examples[6], examples[7]] * 2, tokenizer.pad_token_id)  # a batch without pictures
    model.zero_grad()
    nll_loss(num_targets(text))(model(input_ids=text["input_ids"], attention_mask=text["attention_mask"]).logits,
                                text).loss.backward()
    text_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    got_text = []

    cfg = sft_config(*layout, "train.micro_batch_size=2", f"model.path={tiny_vl_dir}")
    data_parallel = "parallel.dp_shard=2" in layout  # where ranks without pictures run the vision tower idle
    [(metrics, got_sft), (_, got_rl)], got_logprobs, _ = layout_run(
        cfg, sft, rl, counts, then=lambda group: got_text.extend(trained_gradients(group, (text, nll_loss(
            num_targets(text))))) if data_parallel else None, inputs=inputs)
    assert metrics["loss"] == pytest.approx(expected[0][0], rel=1e-5)
    assert_gradients_match(got_sft, expected[0][1])
    assert_gradients_match(got_rl, expected[1][1])
    assert got_sft["model.visual.blocks.0.attn.qkv.weight"].abs().sum() > 0
    if data_parallel:  # a batch without pictures: the vision tower's gradient is zero, every other one transformers'
        [(_, got_text_grads)] = got_text
        assert all(got_text_grads[name].abs().max() == 0 for name in got_text_grads if name not in text_grads)
        assert_gradients_match({name: got_text_grads[name] for name in text_grads}, text_grads)
    mask = sft["attention_mask"]
    assert (got_logprobs * mask - logprobs * mask).abs().max() < 1e-5


def picture_batch(tiny_vl_dir: str, generator: torch.Generator) -> dict:
    """An RL batch of prompts around random pictures of three shapes (4, 8 and 8 image tokens): a group
    of 3 samples of one prompt; two rows of the same text around equal pictures (two copies); two rows
    whose first picture is the same and whose second differs; two whose prompt ends on its picture
    (rows that part right after it); two rows of text."""
    from transformers import AutoConfig

    from rlsys.data.batching import collate_rollouts
    from rlsys.data.image_tokens import ImagePixels

    config = AutoConfig.from_pretrained(tiny_vl_dir)
    vision = config.vision_config
    merge = vision.spatial_merge_size
    values = merge ** 2 * vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    text = lambda n: torch.randint(3, 100, (n,), generator=generator).tolist()  # noqa: E731

    def picture(height: int, width: int) -> tuple[list[int], torch.Tensor]:
        return [1, height, width], torch.randn(height * width // merge ** 2, values, generator=generator)

    def prompt(*parts, closed: bool = True) -> tuple[list[int], ImagePixels | None]:
        ids, starts, grids, pixels = [], [], [], []
        for part in parts:
            if isinstance(part, list):
                ids += part
                continue
            grid, patches = part
            ids.append(config.vision_start_token_id)
            starts.append(len(ids))
            ids += [config.image_token_id] * len(patches) + ([config.vision_end_token_id] if closed else [])
            grids.append(grid)
            pixels.append(patches.clone())
        if not grids:
            return ids, None
        return ids, ImagePixels(starts, [len(p) for p in pixels], torch.tensor(grids), torch.cat(pixels))

    first, second, third, fourth, fifth = picture(4, 4), picture(4, 8), picture(8, 4), picture(4, 4), picture(4, 4)
    before, after, other, between = text(3), text(4), text(2), text(3)
    prompts = [prompt(before, first, after)] * 3 + [prompt(before, second, after), prompt(before, second, after),
                                                     prompt(other, third, between, fourth, after),
                                                     prompt(other, third, between, fifth, after)]
    prompts += [prompt(between, first, closed=False)] * 2 + [prompt(text(5)), prompt(text(6))]
    responses = [text(1 + i % 3) for i in range(len(prompts))]
    batch = collate_rollouts([ids for ids, _ in prompts], responses, pad_id=0,
                             prompt_pixels=[pixels for _, pixels in prompts])
    batch["advantages"] = torch.randn(len(prompts), 1, generator=generator) * batch["loss_mask"]
    return batch


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_packed_rows_with_pictures_give_each_row_its_own_log_probs_and_gradient(vl_dirs, family):
    """`picture_batch` packed as the trainer packs it (`rlsys.data.packed_pictures`): rows that repeat a
    picture after the same tokens lay it out and encode it once, rows whose text is alike but whose
    pictures differ part at the picture, rows that would part right after a picture are laid out
    alone (a picture is read whole), each token at the 3-D rotary positions of its own row. Every
    token's log-prob and the gradient of a token-level loss (the vision tower's included) are the
    padded rows' through transformers' own forward, within 1e-6. A micro-batch of the text rows alone
    packs as text."""
    from transformers import AutoModelForImageTextToText

    from rlsys.algorithms.lm_loss import logprobs_of_labels
    from rlsys.data.image_tokens import GRIDS, IMAGE_TOKENS, PIXELS
    from rlsys.data.packed_pictures import ROPE_POSITIONS, pack_pictured_rows
    from rlsys.models.vision import image_inputs, place_images_by_batch
    from rlsys.parallel.span_attention import SharedPrefixSpans, apply_span_attention, span_inputs

    tiny_vl_dir = vl_dirs(family)
    batch = picture_batch(tiny_vl_dir, torch.Generator().manual_seed(0))

    def grads_and_logprobs(fields, packed: bool, **inputs):
        model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir, dtype=torch.float32)
        place_images_by_batch(model)
        if packed:
            apply_span_attention(model)
        images = image_inputs(model, fields[IMAGE_TOKENS], fields[PIXELS], fields[GRIDS], *fields["input_ids"].shape,
                              torch.device("cpu"))
        logits = model(input_ids=fields["input_ids"], **images, **inputs).logits
        logprobs = logprobs_of_labels(logits, fields["input_ids"])
        (logprobs * (fields["loss_mask"] * fields["advantages"])[:, 1:]).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        return grads, torch.nn.functional.pad(logprobs.detach(), (1, 0)), model

    expected_grads, expected, model = grads_and_logprobs(batch, False, attention_mask=batch["attention_mask"])
    packing = pack_pictured_rows(batch, True, model)
    packed = packing.batch
    # 11 pictures in the rows; laid out: the group's, the two copies' one, the pair's shared first
    # picture and both second ones, and the picture each of the rows that part after it holds
    assert int((batch[GRIDS][..., 0] > 0).sum()) == 11 and int((packed[GRIDS][..., 0] > 0).sum()) == 7
    assert int(packed[IMAGE_TOKENS].sum()) == 4 + 8 + 8 + 4 + 4 + 2 * 4
    assert packed["prefix_ids"].any()
    segments, prefixes = packed["segment_ids"], packed["prefix_ids"]
    grads, logprobs, _ = grads_and_logprobs(packed, True, position_ids=packed[ROPE_POSITIONS].permute(2, 0, 1),
                                            **span_inputs(SharedPrefixSpans.of(segments, prefixes), *segments.shape))
    got = packing.unpack(logprobs)
    real = batch["attention_mask"].bool()
    real[:, 0] = False
    assert (got[real] - expected[real]).abs().max() < 1e-6
    assert grads["model.visual.blocks.0.attn.qkv.weight"].abs().sum() > 0
    for name, grad in expected_grads.items():
        assert (grads[name] - grad).abs().max() <= 1e-6 * max(grad.abs().max(), 1e-6), name
    text_rows = pack_pictured_rows({name: value[-2:] for name, value in batch.items()}, True, model).batch
    assert PIXELS not in text_rows and int(text_rows["attention_mask"].sum()) == int(batch["attention_mask"][-2:].sum())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_the_sft_stage_trains_on_pictures_with_a_frozen_vision_encoder(ray_cluster, sft_config, vl_dirs,
                                                                         dots_sft_file, tmp_path, family):
    """`sft` with `model.freeze_vision` on the picture conversations (2 FSDP2 ranks): the exported
    model has the names of the family's checkpoints (Qwen2-VL's original ones, Qwen3-VL's module
    names); its vision encoder is the initial one, its merger and language model trained."""
    from safetensors.torch import load_file

    from rlsys.run import main

    tiny_vl_dir = vl_dirs(family)
    vision, language = ("visual.", "model.") if family == "qwen2_vl" else ("model.visual.", "model.language_model.")

    out = tmp_path / "sft"
    code = main(["sft", "--config", sft_config.path, f"model.path={tiny_vl_dir}", f"output_dir={out}",
                 f"data.train_files=[{dots_sft_file}]", "data.max_seq_len=64", "train.steps=2",
                 "train.global_batch_size=8", "train.micro_batch_size=2", "model.freeze_vision=true"])
    assert code == 0
    before = load_file(f"{tiny_vl_dir}/model.safetensors")
    after = load_file(f"{out}/hf_model/model.safetensors")
    assert after.keys() == before.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    frozen = tuple(vision + part for part in ("blocks.", "patch_embed.", "pos_embed."))
    assert not any(name.startswith(frozen) for name in changed), changed
    assert any(name.startswith(vision + "merger.") for name in changed)
    assert language + "layers.0.mlp.up_proj.weight" in changed


def test_the_eval_stage_runs_a_vision_language_model_and_a_layout_it_lacks_is_refused(
        ray_cluster, tiny_vl_dir, dots_file, tmp_path, capsys):
    from rlsys.config.loader import load_config
    from rlsys.config.schema import EvalJobConfig
    from rlsys.run import main
    from rlsys.stages.eval import run_eval

    cfg = load_config(EvalJobConfig, None, [f"output_dir={tmp_path / 'eval'}", f"model.path={tiny_vl_dir}",
                                            f"eval.files=[{dots_file}]", "eval.reward=arith", "eval.max_new_tokens=4",
                                            "eval.engine_memory_gib=0.1", "ray.include_dashboard=false"])
    summary = run_eval(cfg)
    assert summary["num_prompts"] == 4 and summary["skipped_rows"] == 3
    capsys.readouterr()  # what loading the data printed
    code = main(["rlvr", "--config", RL_CONFIG, f"model.path={tiny_vl_dir}", f"data.train_files=[{dots_file}]",
                 "eval=null", "parallel.cp=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "parallel.cp: not built yet for a vision-language" in err, err


@pytest.mark.quick
@pytest.mark.parametrize("override", [
                                      "rollout.agent_loop=openai", "rollout.engine_kwargs={mm_processor_kwargs: {}}"])
def test_what_vision_language_rl_lacks_is_refused_before_anything_starts(tiny_vl_dir, dots_file, override):
    from rlsys.config.loader import ConfigError, load_config
    from rlsys.config.schema import RLJobConfig
    from rlsys.stages.preflight import check_rl_job

    cfg = load_config(RLJobConfig, RL_CONFIG, [f"model.path={tiny_vl_dir}", f"data.train_files=[{dots_file}]",
                                               "eval=null", "output_dir=/tmp/unused", override])
    with pytest.raises(ConfigError, match=f"^{override.split('=')[0].split('{')[0]}.*vision-language"):
        check_rl_job(cfg)


ASYNC = ["train.async_mode=one_step", "rollout.placement=separate"]


@pytest.mark.quick
@pytest.mark.parametrize("overrides", [["model.lora.rank=8"], ASYNC, ["algorithm.adv_estimator=gae"]],
                         ids=["lora", "async", "critic"])
def test_lora_asynchronous_and_critic_vision_language_rl_pass_preflight(vl_dirs, dots_file, overrides):
    from rlsys.config.loader import load_config
    from rlsys.config.schema import RLJobConfig
    from rlsys.stages.preflight import check_rl_job

    cfg = load_config(RLJobConfig, RL_CONFIG, [f"model.path={vl_dirs('qwen3_vl')}", f"data.train_files=[{dots_file}]",
                                               "eval=null", "output_dir=/tmp/unused", *overrides])
    check_rl_job(cfg)


def picture_logprob_gap(trainer) -> float:
    """The largest gap between vLLM's log-probs of 2 samples of each picture prompt and the trainer's."""
    from rlsys.data.batching import collate_rollouts

    prompts = [(i, p.ids, p.row) for i, p in enumerate(trainer.prompts)]
    samples, _ = trainer.rollout_group.rollout(prompts, "single_turn", 2, trainer.rollout_group.sampling(), seed=1)
    prompt_ids, pixels = trainer.rl_step.prompts_with_pictures(samples)
    batch = collate_rollouts(prompt_ids, [s.response_ids for s in samples], trainer.tokenizer.pad_token_id,
                             prompt_pixels=pixels)
    ours = trainer.rl_step.passes.policy(batch)[0]
    return max((ours[row, len(ids):len(ids) + len(s.response_ids)] - torch.tensor(s.logprobs)).abs().max().item()
               for row, (ids, s) in enumerate(zip(prompt_ids, samples)))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["qwen2_vl"])  # Qwen2.5-VL's sync: the critic's test; Qwen3-VL's: async
def test_rl_steps_on_pictures_and_the_sync_carries_the_vision_tower(ray_cluster, rl_config, vl_dirs, dots_file,
                                                                     family):
    """GRPO steps on the picture prompts (2 FSDP2 ranks, a colocated engine): the engine's log-probs of
    what it sampled equal the trainer's given the pictures; after every weight, the vision tower's too, is
    perturbed and synced, they equal them again within 1e-4 (and differed before)."""
    import worker_probes as probes

    from rlsys.stages.rl_trainer import RLVRTrainer

    cfg = rl_config(f"model.path={vl_dirs(family)}", f"data.train_files=[{dots_file}]", "eval=null",
                    "train.prompts_per_step=4", "algorithm.ppo_mini_batch_size=2", "rollout.max_new_tokens=4",
                    "reward.terms=[{name: arith}]")
    trainer = RLVRTrainer(cfg)
    try:
        metrics = trainer.step(1)
        assert metrics["rollout/logprob_abs_diff"] < 1e-4, metrics
        assert picture_logprob_gap(trainer) < 1e-4  # the update, synced
        trainer.train_group.on_each(probes.perturb_parameters, 0.05, cfg.seed, False, "model.visual.")
        assert picture_logprob_gap(trainer) > 1e-2
        trainer.sync.run()
        assert picture_logprob_gap(trainer) < 1e-4
    finally:
        trainer.shutdown()


@pytest.mark.timeout(600)
def test_lora_rl_on_pictures_adapts_the_language_model_and_syncs_its_adapters(ray_cluster, rl_config, vl_dirs,
                                                                              dots_file, tmp_path):
    """GRPO with LoRA adapters (every linear layer) on a Qwen2.5-VL, 2 FSDP2 ranks: the adapters go on
    the language model alone, the vision tower stays as loaded; the engine, serving the synced adapters
    over the base, gives the trainer's log-probs of picture prompts (perturbed adapters differ until
    the next sync); the export is a merged model and a peft adapter that agree on a picture."""
    import peft
    import worker_probes as probes
    from safetensors.torch import load_file
    from test_rlvr import COIN
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlsys.data.images import load_images
    from rlsys.stages.rl_trainer import RLVRTrainer

    model_dir = vl_dirs("qwen2_5_vl")  # rewarded by a coin: the tiny model counts no dots
    cfg = rl_config(f"model.path={model_dir}", f"data.train_files=[{dots_file}]", "eval=null",
                    "train.prompts_per_step=4", "algorithm.ppo_mini_batch_size=2", "rollout.max_new_tokens=4",
                    f"reward.terms=[{{path: {COIN}}}]", "model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2")
    trainer = RLVRTrainer(cfg)
    try:
        trainer.resume()  # the first adapters reach the engine
        metrics = trainer.step(1)
        assert metrics["rollout/logprob_abs_diff"] < 1e-4 and metrics["sync/mb"] < 0.1, metrics
        adapters = trainer.train_group.on_each(probes.full_adapters)[0]
        assert adapters and all(name.startswith("model.language_model.") for name in adapters)
        assert any(tensor.abs().max() > 0 for name, tensor in adapters.items() if ".lora_B." in name)  # trained
        trainer.train_group.on_each(probes.perturb_adapters, 0.05, cfg.seed)
        assert picture_logprob_gap(trainer) > 1e-2
        trainer.sync.run()
        assert picture_logprob_gap(trainer) < 1e-4
        trainer.train_group.run_all(TrainWorker.export_hf, str(tmp_path / "hf_model"))
    finally:
        trainer.shutdown()
    out = tmp_path / "hf_model"
    before, after = load_file(f"{model_dir}/model.safetensors"), load_file(f"{out}/model.safetensors")
    assert after.keys() == before.keys()
    assert all(torch.equal(before[name], after[name]) for name in before if name.startswith("visual."))
    processor = AutoProcessor.from_pretrained(str(out))
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    inputs = processor(text=[text], images=load_images([dots(3)]), return_tensors="pt")
    load = lambda path: AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    with torch.no_grad():
        merged = load(str(out))(**inputs).logits
        adapted = peft.PeftModel.from_pretrained(load(model_dir), str(out / "adapter"))(**inputs).logits
        base = load(model_dir)(**inputs).logits
    assert (merged - adapted).abs().max() < 1e-5 and (merged - base).abs().max() > 1e-3


@pytest.mark.timeout(600)
def test_asynchronous_rl_on_pictures_and_a_rollout_in_flight_under_new_weights(ray_cluster, rl_config, vl_dirs,
                                                                               dots_file):
    """`full` asynchronous RL on a Qwen3-VL, an engine of its own: weights, the vision tower's included,
    arrive while picture prompts are being sampled; each response keeps its tokens, those after the
    sync say version 1, and the engine's log-prob of every token equals the trainer's under that
    token's weights (the engine recomputed the pictures' features and the KV cache of the requests in
    flight). Then 3 steps from the stream train on pictures within the staleness bound."""
    from test_async_rl import LONG_RESPONSE, assert_each_token_scored_by_its_weights, sample_across_a_sync
    from test_rlvr import COIN

    from rlsys.stages.rl_trainer import RLVRTrainer

    cfg = rl_config(f"model.path={vl_dirs('qwen3_vl')}", f"data.train_files=[{dots_file}]", "eval=null",
                    "train.prompts_per_step=2", "algorithm.ppo_mini_batch_size=2", "rollout.max_new_tokens=4",
                    f"reward.terms=[{{path: {COIN}}}]", "train.async_mode=full", "train.max_staleness=1",
                    "rollout.placement=separate", "parallel.dp_shard=1", "ray.cpus_per_worker=1",
                    f"rollout.max_model_len={LONG_RESPONSE + 256}")  # the long responses, after the pictures
    trainer = RLVRTrainer(cfg)
    try:
        samples, prompt_ids, old, new = sample_across_a_sync(trainer, range(len(trainer.prompts)), cfg.seed)
        trainer.sync.run(version=0)
        rows = [trainer.step(step) for step in range(1, 4)]
    finally:
        trainer.shutdown()
    assert_each_token_scored_by_its_weights(samples, prompt_ids, old, new)
    assert all(row["async/staleness_max"] <= 1 for row in rows) and rows[-1]["async/staleness_1_share"] > 0
    assert rows[-1]["actor/grad_norm"] > 0


@pytest.mark.timeout(600)
def test_ppo_critic_reads_the_pictures(ray_cluster, rl_config, vl_dirs, dots_file):
    """PPO with a critic (GAE) on a Qwen2.5-VL's picture prompts: the critic, a value head on the
    vision-language model, trains, and after 2 steps its values of prompts whose text is the same and
    whose pictures differ (1 to 4 dots) differ: the pictures reach its forward. The engine's log-probs
    equal the policy's after each sync, a perturbed vision tower's too (and differ before it)."""
    import worker_probes as probes
    from test_rlvr import COIN

    from rlsys.data.batching import collate_rollouts
    from rlsys.stages.rl_trainer import RLVRTrainer

    cfg = rl_config(f"model.path={vl_dirs('qwen2_5_vl')}", f"data.train_files=[{dots_file}]", "eval=null",
                    "train.prompts_per_step=4", "algorithm.ppo_mini_batch_size=2", "rollout.max_new_tokens=4",
                    f"reward.terms=[{{path: {COIN}}}]", "algorithm.adv_estimator=gae", "critic.optim.lr=5e-2",
                    "critic.warmup_steps=0")
    trainer = RLVRTrainer(cfg)
    try:
        rows = [trainer.step(step) for step in (1, 2)]
        assert picture_logprob_gap(trainer) < 1e-4  # the update, synced
        trainer.train_group.on_each(probes.perturb_parameters, 0.05, cfg.seed, False, "model.visual.")
        assert picture_logprob_gap(trainer) > 1e-2
        trainer.sync.run()
        assert picture_logprob_gap(trainer) < 1e-4
        prompts = trainer.prompts
        assert len({tuple(p.ids) for p in prompts}) == 1  # one text, four pictures
        prompt_ids, pixels = trainer.expander.expand_prompts([(p.ids, p.images) for p in prompts])
        batch = collate_rollouts(prompt_ids, [[5, 6]] * len(prompts), trainer.tokenizer.pad_token_id,
                                 prompt_pixels=pixels)
        from rlsys.algorithms.value_loss import token_values

        values = torch.cat([out["values"] for out, _ in trainer.train_group.run_data_parallel(
            TrainWorker.forward, batch, loss_fn=token_values, role="critic")])
    finally:
        trainer.shutdown()
    assert all(row["critic/grad_norm"] > 0 for row in rows)
    first_response = values[:, len(prompt_ids[0])]
    # ~1e-2 values after two updates differ by 2e-5..8e-5 with the picture: far above float32's
    # noise at that size (~1e-9), which is all the same text would give without its pictures
    assert (first_response - first_response[0]).abs().max() > 1e-5, first_response
