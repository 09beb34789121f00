"""Sequence classifiers used as reward models: load one, and build tiny random ones for tests.

A reward model reads a whole (prompt, completion) conversation and returns one logit per label;
the reward is the logit of one label (usually the only one). Any Hugging Face
`AutoModelForSequenceClassification` directory works. Tests use a random Llama classifier with
the repo's character tokenizer (`tiny`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, LlamaForSequenceClassification,
                          PreTrainedModel, PreTrainedTokenizerBase)

from k3post.config.errors import UserError
from k3post.config.schema import RewardModelSpec, TinyModelSpec
from k3post.model.loading.tiny import build_tiny_tokenizer, tiny_config


def build_tiny_classifier(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerBase, num_labels: int = 1
                          ) -> LlamaForSequenceClassification:
    """A random Llama classifier (seeded, the same weights in every process)."""
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        return LlamaForSequenceClassification(tiny_config(spec, tokenizer, num_labels=num_labels))


def save_tiny_classifier(spec: TinyModelSpec, directory: Path, num_labels: int = 1) -> Path:
    """Write a tiny classifier and its tokenizer as a normal HF directory (what users point `path` at)."""
    tokenizer = build_tiny_tokenizer()
    build_tiny_classifier(spec, tokenizer, num_labels).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_classifier(spec: RewardModelSpec) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The classifier and its tokenizer, in eval mode, with a pad token the model knows about
    (batched scoring pads, and HF classifiers pool the last non-pad token)."""
    if spec.tiny is not None:
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_classifier(spec.tiny, tokenizer)
    else:
        path = Path(spec.path)
        if not (path / "config.json").is_file():
            raise UserError(f"reward model {path}: not a Hugging Face model directory (no config.json)")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if spec.label >= model.config.num_labels:
        raise UserError(f"reward model {spec.path or 'tiny'}: label {spec.label} but the model has "
                        f"{model.config.num_labels} label(s)")
    tokenizer.truncation_side = "left"  # keep the end: the completion being judged
    return model.eval(), tokenizer
