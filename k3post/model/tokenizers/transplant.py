"""Tokenizer transplant: the same model body under a new tokenizer (docs/transplant.md).

A model maps token ids to rows of its embedding matrix E (V_old × H) and, with tied embeddings,
scores the next token as h·Eᵀ with the same matrix. To give it a new tokenizer of V_new tokens,
every new token t needs a row. The new token is a string of bytes; the old tokenizer splits that
string into old tokens o_1..o_k(t), and the model already knows what those mean in sequence.
The transplant sets

    E_new[t] = (1 / k(t)) · Σ_j E_old[o_j]                 (the mean of the old rows)

so a new token that is exactly one old token keeps that token's row unchanged (k = 1), and a
merge of several old tokens starts at their centroid. With a tied head the output side follows:
the new logit h·E_new[t] is the mean of the old logits h·E_old[o_j] of its pieces. Special tokens
(`<|im_start|>`, ...) take the old row of the same string. A token with no old counterpart (a
special the old vocabulary lacks; a byte fragment an old tokenizer without bytes cannot spell)
gets the mean of all old rows, E_new[t] = mean_v E_old[v], the "average token".

This is an initialisation, not a conversion: the body has only seen old-token sequences, so the
transplanted model is worse than the original until it is trained (on-policy distillation from
teachers that keep the old tokenizer, e.g.).

- `train_bpe_tokenizer`: a byte-level BPE (`tokenizers`), alphabet = all 256 bytes, so every
  text encodes; the base tokenizer's special tokens, chat template and bos/eos/pad/unk strings.
- `map_tokens`: for each new token, the old ids whose mean is its row.
- `transplant_embeddings`: the new matrix, the resized and tied model, its config's ids.
- `build_transplanted`: a `TransplantSpec` to an ordinary HF directory (model/loading/load.py caches it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from k3post.config.errors import UserError, located, shorten
from k3post.config.model_schema import ModelSpec, TransplantSpec
from k3post.model.loading.checks import TOKENIZER_FILES
from k3post.model.tokenizers.corpus import corpus_fingerprint, read_corpus
from k3post.model.tokenizers.token_text import TokenText, backend_spec, byte_alphabet, decoder_family
from k3post.model.tokenizers.transplant_head import chain_head

logger = logging.getLogger("k3post.model.tokenizers.transplant")
REPORT_FILE = "transplant.json"
VERSION = "transplant-v1"  # part of the cache key: bump when the construction changes


def special_tokens_of(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The special tokens of a tokenizer, by id: its added tokens marked special, then its
    bos/eos/pad/unk strings if they are not among them."""
    added = [t.content for _, t in sorted(tokenizer.added_tokens_decoder.items()) if t.special]
    named = [getattr(tokenizer, f"{n}_token") for n in ("bos", "eos", "pad", "unk")]
    return list(dict.fromkeys([*added, *(t for t in named if isinstance(t, str))]))


def check_vocab_size(vocab_size: int, specials: list[str]) -> None:
    """A byte-level BPE holds the 256 bytes and the special tokens before its first merge."""
    least = 256 + len(specials)
    if vocab_size < least:
        raise UserError(f"vocab_size {vocab_size} is too small: a byte-level tokenizer needs 256 byte tokens + "
                        f"{len(specials)} special tokens of the base's tokenizer ({shorten(', '.join(specials))}) "
                        f"= {least} ids before any merge; give vocab_size >= {least} (8000-16000 is typical)")


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether encoding a text with special tokens puts the BOS token first."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, like: PreTrainedTokenizerBase,
                        min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most `vocab_size` tokens trained on `texts`, dressed like `like`.

    Ids 0..k-1 are `like`'s special tokens (in `like`'s id order), then the 256 bytes, then the
    merges, most frequent pair first (a pair seen fewer than `min_frequency` times is never
    merged, so a small corpus gives fewer tokens than asked). GPT-2's pre-tokenizer regex splits
    words, numbers and punctuation first; merges never cross those splits. The BOS token is put
    first when `like` puts it first (Llama 3), not otherwise (SmolLM2). No randomness: the same
    texts in the same order give the same tokenizer.
    """
    specials = special_tokens_of(like)
    check_vocab_size(vocab_size, specials)
    core = Tokenizer(models.BPE())  # no unk token: every byte is in the alphabet
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer=trainer)
    if _adds_bos(like):  # Llama 3 style: every encoding starts with the BOS token, as `like`'s does
        bos = (like.bos_token, core.token_to_id(like.bos_token))
        core.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B:1",
                                          special_tokens=[bos])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=like.bos_token, eos_token=like.eos_token, pad_token=like.pad_token,
        unk_token=like.unk_token, model_max_length=like.model_max_length, clean_up_tokenization_spaces=False)
    tokenizer.chat_template = like.chat_template
    return tokenizer


@dataclass(frozen=True)
class TokenMap:
    """`old_ids[t]`: the old ids whose mean is new row t ([]: no counterpart, the mean of all old
    rows); `special[t]`: whether new token t is a special token."""

    old_ids: list[list[int]]
    special: list[bool]


def byte_splitter(old: PreTrainedTokenizerBase) -> Callable[[bytes], list[int]]:
    """How the old tokenizer splits bytes that are not whole UTF-8 text (a fragment of a
    character): its BPE model run on them directly when it is byte-level, else its byte-fallback
    tokens <0xNN> (SentencePiece), else no pieces ([]).

    A byte-level vocabulary may lack bytes it never saw (SmolLM2 has 235 of the 256: not 0xC0,
    0xF5-0xFF, ...); its BPE model silently drops such a byte and would merge across the gap,
    so the bytes on either side are tokenized apart and the missing one contributes no row."""
    vocab = old.get_vocab()
    if getattr(old, "is_fast", False) and decoder_family(backend_spec(old)) == "byte_level" \
            and isinstance(old.backend_tokenizer.model, models.BPE):
        bpe = old.backend_tokenizer.model
        char_of = {b: c for c, b in byte_alphabet().items() if c in vocab}

        def split(raw: bytes) -> list[int]:
            runs = "".join(char_of.get(b, " ") for b in raw).split()
            return [t.id for run in runs for t in bpe.tokenize(run)]
        return split
    fallback = {b: vocab.get(f"<0x{b:02X}>") for b in range(256)}
    return lambda raw: [] if any(fallback[b] is None for b in raw) else [fallback[b] for b in raw]


def map_tokens(old: PreTrainedTokenizerBase, new: PreTrainedTokenizerBase) -> TokenMap:
    """For each new id, the old ids of its exact text as the old tokenizer splits it.

    A new token's bytes are read off its vocabulary string by its decoder's rule (model/tokenizers/token_text.py:
    byte-level, SentencePiece, WordPiece, plain). Whole UTF-8 text is encoded by the old tokenizer
    (no special tokens added, its unknown-token id dropped); a character fragment goes through
    `byte_splitter`. An added token whose string the old vocabulary has takes that old id (the
    specials: `<|im_end|>` -> `<|im_end|>`); a special one it lacks has no counterpart.
    """
    added, old_vocab = new.added_tokens_decoder, old.get_vocab()
    special_ids = {i for i, token in added.items() if token.special} | set(new.all_special_ids)
    special = [i in special_ids for i in range(len(new))]
    old_ids: list[list[int]] = [[] for _ in range(len(new))]
    whole: dict[int, str] = {}
    split_bytes = byte_splitter(old)
    for i, raw in enumerate(TokenText(new).bytes_of):
        if i in added and added[i].content in old_vocab:
            old_ids[i] = [old_vocab[added[i].content]]
        elif special[i] or not raw:
            continue
        elif _is_utf8(raw):
            whole[i] = raw.decode("utf-8")
        else:
            old_ids[i] = split_bytes(raw)
    encoded = old(list(whole.values()), add_special_tokens=False)["input_ids"] if whole else []
    for i, ids in zip(whole, encoded):
        old_ids[i] = [j for j in ids if j != old.unk_token_id]
    return TokenMap(old_ids, special)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def mean_rows(old_rows: torch.Tensor, old_ids: list[list[int]]) -> torch.Tensor:
    """Row t = mean of old_rows[old_ids[t]] (fp32 sums); rows with no ids (or only ids past the
    old matrix) = the mean of all old rows. old_rows: [V_old, H] -> [len(old_ids), H]."""
    rows_V_H = old_rows.detach().float()
    ids = [[j for j in row if j < rows_V_H.shape[0]] for row in old_ids]
    counts_N = torch.tensor([len(row) for row in ids])
    flat = torch.tensor([j for row in ids for j in row], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(ids)), counts_N)
    sums_N_H = torch.zeros(len(ids), rows_V_H.shape[1]).index_add_(0, owner, rows_V_H[flat])
    means_N_H = sums_N_H / counts_N.clamp(min=1).unsqueeze(1)
    means_N_H[counts_N == 0] = rows_V_H.mean(0)
    return means_N_H.to(old_rows.dtype)


def is_tied(model: PreTrainedModel) -> bool:
    """Whether the output head is the input embedding (one matrix, as SmolLM2 and Llama 3.2 have)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is embed.weight


def require_tied(model: PreTrainedModel, where: str) -> None:
    if not is_tied(model):
        raise UserError(f"{where}: the model's output head is not tied to its input embedding (tie_word_embeddings "
                        "is false); a transplant builds one matrix for both, so it needs a tied base (SmolLM2, "
                        "Llama 3.2 1B/3B, Qwen2.5 0.5B)")


def _same_strings(ids: int | list[int] | None, old: PreTrainedTokenizerBase,
                  new: PreTrainedTokenizerBase) -> int | list[int] | None:
    """Old token ids -> the new ids of the same token strings (those the new vocabulary has)."""
    listed = [ids] if isinstance(ids, int) else list(ids or [])
    vocab = new.get_vocab()
    mapped = [vocab[s] for s in old.convert_ids_to_tokens(listed) if s in vocab]
    return mapped[0] if len(mapped) == 1 else (mapped or None)


def _retarget_ids(model: PreTrainedModel, old: PreTrainedTokenizerBase, new: PreTrainedTokenizerBase) -> None:
    """config and generation_config ids -> the new tokenizer's: eos ids by their strings (a model
    may stop on several), bos/pad/unk from the new tokenizer."""
    configs = [c for c in (model.config, model.generation_config) if c is not None]
    for config in configs:
        config.eos_token_id = _same_strings(config.eos_token_id, old, new) or new.eos_token_id
        config.bos_token_id = new.bos_token_id
        config.pad_token_id = new.pad_token_id if new.pad_token_id is not None else new.eos_token_id
    if hasattr(model.config, "unk_token_id"):
        model.config.unk_token_id = new.unk_token_id


def transplant_embeddings(model: PreTrainedModel, old_tokenizer: PreTrainedTokenizerBase,
                          new_tokenizer: PreTrainedTokenizerBase, token_map: TokenMap | None = None,
                          head: str = "tied", texts: list[str] | None = None) -> PreTrainedModel:
    """`model` (changed in place and returned) with one embedding row per new token, the mean of
    its old pieces' rows (module docstring), and its config's vocab_size and bos/eos/pad ids
    (generation_config's too) those of the new tokenizer. `head`: "tied" (the head is the new
    embedding) or "chain" (a head of its own keeping the old next-token probabilities,
    model/tokenizers/transplant_head.py; its constant direction fitted on `texts`, the built-in corpus when None).

    `token_map`: `map_tokens(old_tokenizer, new_tokenizer)`, computed here when not given.
    """
    require_tied(model, type(model).__name__)
    token_map = token_map or map_tokens(old_tokenizer, new_tokenizer)
    weight = model.get_input_embeddings().weight
    new_rows = mean_rows(weight[: min(len(old_tokenizer), weight.shape[0])], token_map.old_ids)
    head_rows = chain_head(model, old_tokenizer, token_map.old_ids, texts or read_corpus(None)) \
        if head == "chain" else None
    model.resize_token_embeddings(len(new_tokenizer), mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(new_rows)
    model.tie_weights()
    assert is_tied(model), "resize_token_embeddings untied the head"
    if head_rows is not None:
        untie_head(model, head_rows)
    model.config.vocab_size = len(new_tokenizer)
    _retarget_ids(model, old_tokenizer, new_tokenizer)
    return model


def untie_head(model: PreTrainedModel, rows_V_H: torch.Tensor) -> None:
    """Give `model` an output head of its own holding `rows_V_H` (saved as lm_head.weight and
    loaded untied: config.tie_word_embeddings false)."""
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    model.get_output_embeddings().weight = torch.nn.Parameter(rows_V_H.clone())
    assert not is_tied(model)


@dataclass(frozen=True)
class TransplantReport:
    """What a transplant did (written as transplant.json beside the model)."""

    old_vocab: int
    new_vocab: int
    one_old_token: float    # share of the regular new tokens whose text is exactly one old token
    mean_old_tokens: float  # mean old tokens per regular new token (those with a counterpart)
    specials_matched: str   # "3/3": special tokens that found the old row of the same string
    averaged: int           # rows set to the mean of all old rows (no counterpart)
    seconds: float

    def line(self, directory: Path | str) -> str:
        return (f"vocabulary {self.old_vocab:,} -> {self.new_vocab:,} tokens; {self.one_old_token:.1%} of the new "
                f"tokens are one old token, {self.mean_old_tokens:.2f} old tokens per new token on average; "
                f"specials matched {self.specials_matched}, {self.averaged} rows averaged; "
                f"{self.seconds:.1f}s; written to {directory}")


def describe(token_map: TokenMap, old_vocab: int, seconds: float) -> TransplantReport:
    regular = [ids for ids, special in zip(token_map.old_ids, token_map.special) if not special]
    found = [len(ids) for ids in regular if ids]
    specials = [ids for ids, special in zip(token_map.old_ids, token_map.special) if special]
    return TransplantReport(
        old_vocab=old_vocab, new_vocab=len(token_map.old_ids),
        one_old_token=sum(n == 1 for n in found) / max(len(regular), 1),
        mean_old_tokens=sum(found) / max(len(found), 1),
        specials_matched=f"{sum(bool(ids) for ids in specials)}/{len(specials)}",
        averaged=sum(not ids for ids in token_map.old_ids), seconds=round(seconds, 2))


def load_new_tokenizer(directory: str) -> PreTrainedTokenizerBase:
    """A user's tokenizer directory, its failures named."""
    path = Path(directory)
    if not path.is_dir() or not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(located(path, f"expected a tokenizer directory (one of {', '.join(TOKENIZER_FILES)})"))
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise UserError(located(path, f"the tokenizer does not load: {type(err).__name__}: "
                                      f"{shorten(str(err), 300)}")) from err


def new_tokenizer_for(spec: TransplantSpec, old: PreTrainedTokenizerBase,
                      progress: Callable[[str], None]) -> PreTrainedTokenizerBase:
    """The tokenizer a spec transplants onto: given, or trained (vocab_size checked before the
    corpus is read)."""
    if spec.tokenizer is not None:
        return load_new_tokenizer(spec.tokenizer)
    if spec.tokenizer_from is not None:
        from k3post.model.loading.load import load_tokenizer  # noqa: PLC0415 - load.py dispatches here

        return load_tokenizer(spec.tokenizer_from)
    check_vocab_size(spec.vocab_size, special_tokens_of(old))
    texts = read_corpus(spec.corpus)
    where = "the built-in corpus" if spec.corpus is None else f"{len(spec.corpus)} corpus file(s)"
    progress(f"training a {spec.vocab_size:,}-token byte-level BPE on {where} "
             f"({sum(map(len, texts)) / 1e6:.1f}M characters)")
    return train_bpe_tokenizer(texts, spec.vocab_size, like=old)


def build_transplanted(spec: TransplantSpec, directory: Path | str,
                       progress: Callable[[str], None] = logger.info) -> TransplantReport:
    """Write the model `spec` describes to `directory` as an ordinary HF directory (weights,
    config, generation_config, tokenizer, chat template) plus transplant.json; return the report."""
    from k3post.model.loading.load import load_model, load_tokenizer  # noqa: PLC0415 - load.py dispatches here

    started = time.time()
    old = load_tokenizer(spec.base)
    new = new_tokenizer_for(spec, old, progress)
    model, old = load_model(spec.base)
    require_tied(model, f"transplant.base ({base_name(spec.base)})")
    progress(f"mapping {len(new):,} new tokens onto {len(old):,} old ones and averaging their embeddings")
    token_map = map_tokens(old, new)
    if spec.head == "chain":
        progress("fitting the head's constant direction and scoring each new token's old pieces (head: chain)")
    transplant_embeddings(model, old, new, token_map, head=spec.head, texts=read_corpus(spec.corpus))
    directory = Path(directory)
    model.save_pretrained(directory)
    new.save_pretrained(directory)
    report = describe(token_map, len(old), time.time() - started)
    (directory / REPORT_FILE).write_text(json.dumps({**asdict(report), "spec": spec.model_dump()}, indent=2) + "\n")
    return report


def base_name(spec: ModelSpec) -> str:
    """A few words naming a model spec's source, for messages."""
    for key in ("builtin", "path", "gguf"):
        if getattr(spec, key) is not None:
            return f"{key}: {getattr(spec, key)}"
    return next(k for k in ("tiny", "kimi", "transplant") if getattr(spec, k) is not None)


def transplant_key(spec: TransplantSpec) -> str:
    """The cache key: the spec, and what its files hold (corpus texts, the given tokenizer's files)."""
    if spec.tokenizer_from is not None:  # a model spec: its own cache keys cover its files
        content = ""
    elif spec.tokenizer is None:
        content = corpus_fingerprint(spec.corpus)
    else:
        content = corpus_fingerprint([str(Path(spec.tokenizer) / n) for n in TOKENIZER_FILES])
    return hashlib.sha256(f"{VERSION}:{spec.model_dump_json()}:{content}".encode()).hexdigest()[:12]
