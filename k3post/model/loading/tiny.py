"""Tiny random models and a character-level chat tokenizer, built locally (no hub).

Tests and smoke recipes use these: a Llama-shaped model of a few layers with the repo's
own tokenizer, so the whole pipeline runs in seconds on a CPU without downloading anything.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from k3post.config.schema import TinyModelSpec

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A ChatML tokenizer over printable ASCII characters (~100 ids)."""
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>", bos_token=None
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A randomly initialised Llama with tied embeddings, seeded so every process builds the same weights."""
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        return LlamaForCausalLM(tiny_config(spec, tokenizer))


def tiny_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast, **extra) -> LlamaConfig:
    """The LlamaConfig of a tiny model (`extra`: e.g. num_labels for a classifier)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=spec.init_std,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **extra,
    )


def save_tiny(spec: TinyModelSpec, directory: Path) -> Path:
    """Write a tiny model and its tokenizer as a normal HF directory (for HF-path tests)."""
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(spec, tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
