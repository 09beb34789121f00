"""Real tokenizers of other families, trained here with the `tokenizers` library (no hub), and tiny
Llama teachers over them saved as ordinary HF directories: the other side of cross-tokenizer tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from k3post.model.loading.tiny import CHAT_TEMPLATE

CHATML = ["<pad>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is 11 + 6? The answer is 17.", "In 2026 the team trained a student from three teachers.",
    "Café, naïve, résumé and coöperate carry accents; e\u0301 is an e with a combining accent.",
    "Emoji 😀🎉 and a family 👩‍👩‍👧 are many bytes each.", "日本語のテキストと中文文本。", "Tabs\tand  double spaces\nand new lines.\n\n",
    "def add(a, b):\n    return a + b\n", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2026 31415.",
    "A helpful assistant answers the question politely and briefly.", "hello world, hello there, hello again",
] * 4


def _fast(core: Tokenizer, template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>")
    tokenizer.chat_template = template
    return tokenizer


def byte_level_bpe(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE (the Qwen / Llama 3 / SmolLM2 family), other merges than SmolLM2's."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(CORPUS, trainer)
    return _fast(core)


def metaspace_bpe(vocab_size: int = 500) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (the Llama 2 / Mistral / Gemma family): "▁" for spaces, a prefix
    space on the first word, <0xNN> byte fallback for characters outside its vocabulary."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    pre_tokenizer = pre_tokenizers.Split(Regex("▁"), behavior="merged_with_next")
    draft = Tokenizer(models.BPE())
    draft.normalizer, draft.pre_tokenizer = normalizer, pre_tokenizer
    draft.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML))
    spec = json.loads(draft.to_str())["model"]
    vocab = dict(spec["vocab"])
    for b in range(256):  # the byte-fallback pieces are ordinary vocabulary entries, as in Llama 2
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    core = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    core.normalizer, core.pre_tokenizer = normalizer, pre_tokenizer
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    core.add_special_tokens(CHATML)
    return _fast(core)


def tiny_teacher_dir(directory: Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0, hidden: int = 32,
                     init_std: float = 0.02, heads: int = 4) -> Path:
    """A random tiny Llama over `tokenizer`, saved with it as a model directory (`ModelSpec(path=...)`)."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=1024, tie_word_embeddings=True, initializer_range=init_std,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(directory)
    return directory


def permuted_tiny_teacher_dir(directory: Path, spec, seed: int = 7) -> Path:
    """The tiny teacher of `spec` (a TinyModelSpec) behind a tokenizer whose ids are a permutation of
    the repo's tiny tokenizer's: the same model on the same text, a different vocabulary, so it
    takes the cross-tokenizer path (every chunk 1:1). Its embedding (= head) rows are permuted
    with the ids."""
    from tokenizers import Tokenizer as Core

    from k3post.model.loading.tiny import build_tiny_model, build_tiny_tokenizer

    base = build_tiny_tokenizer()
    vocab = base.get_vocab()
    order = torch.randperm(len(vocab), generator=torch.Generator().manual_seed(seed)).tolist()
    permuted = {token: order[i] for token, i in vocab.items()}
    core = Core.from_str(base.backend_tokenizer.to_str())
    core_spec = json.loads(core.to_str())
    core_spec["model"]["vocab"] = permuted
    for added in core_spec["added_tokens"]:
        added["id"] = permuted[added["content"]]
    tokenizer = _fast(Core.from_str(json.dumps(core_spec)))
    tokenizer.pad_token = "<pad>"
    model = build_tiny_model(spec, base)
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        rows = weight.clone()
        weight[torch.tensor(order)] = rows
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(directory)
    return directory
