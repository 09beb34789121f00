"""The exact bytes of every token, and a tokenization's byte offsets: what a teacher with another
tokenizer needs to read the student's text (k3post/algo/cross_tokenizer.py has the maths).

`tokenizer.decode` is not exact for this: it cleans up spaces, strips a leading one, and turns a
token that holds half of a UTF-8 character into U+FFFD. So each token's bytes are read off its
vocabulary string by the rule of its tokenizer's decoder family:

- ByteLevel (GPT-2, Llama 3, Qwen, SmolLM2): every character of the string stands for one byte
  (GPT-2's printable byte alphabet, `byte_alphabet`).
- Metaspace / SentencePiece (Llama 2, Mistral, Gemma): "▁" is a space, `<0xNN>` byte-fallback
  tokens are the byte NN, everything else is its UTF-8.
- WordPiece (BERT-style): "##x" continues a word, any other token starts one after a space.
- Plain (WordLevel or character vocabularies whose decoder only fuses): the string is the text.

Added and special tokens are their content ("<|im_start|>"): a student that writes one in the
middle of an answer has written that text, and the teacher's tokenizer parses it back into its own
special token where it has one with that content (else it reads the characters). A slow (Python)
tokenizer has no offsets and no backend to read: it is refused (`TokenText` raises `UserError`).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from itertools import accumulate

from k3post.config.errors import UserError

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """GPT-2's map from the 256 printable stand-in characters back to the bytes they encode."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def backend_spec(tokenizer) -> dict:
    """The tokenizers-library JSON of a fast tokenizer (normaliser, pre-tokenizer, model, decoder)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        raise UserError(f"the tokenizer {type(tokenizer).__name__} is a slow (Python) tokenizer: the cross-tokenizer "
                        f"path needs a fast one, with character offsets; save the model with a tokenizer.json "
                        f"(`AutoTokenizer.from_pretrained(dir, use_fast=True).save_pretrained(dir)`)")
    return json.loads(backend.to_str())


def decoder_family(spec: dict) -> str:
    """byte_level | metaspace | wordpiece | plain, from the decoder (and model) of `spec`."""
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    types = {part.get("type") for part in parts if part}
    if "ByteLevel" in types:
        return "byte_level"
    if "WordPiece" in types:
        return "wordpiece"
    if types & {"Metaspace", "Replace", "ByteFallback"}:
        return "metaspace"
    if types <= {"Fuse", "Strip"}:
        return "plain"
    raise UserError(f"the tokenizer's decoder ({', '.join(sorted(t for t in types if t))}) is not one whose tokens' "
                    f"exact text k3post can read (ByteLevel, Metaspace/SentencePiece, WordPiece, or plain)")


def piece_bytes(piece: str, family: str) -> bytes:
    """The bytes one vocabulary string stands for, by the decoder family's rule."""
    if family == "byte_level":
        alphabet = byte_alphabet()
        if all(ch in alphabet for ch in piece):
            return bytes(alphabet[ch] for ch in piece)
        return piece.encode()
    if family == "metaspace":
        fallback = BYTE_FALLBACK.fullmatch(piece)
        return bytes([int(fallback.group(1), 16)]) if fallback else piece.replace("▁", " ").encode()
    if family == "wordpiece":
        return piece[2:].encode() if piece.startswith("##") else b" " + piece.encode()
    return piece.encode()


class TokenText:
    """Every id's exact bytes, built once per tokenizer."""

    def __init__(self, tokenizer):
        self.family = decoder_family(backend_spec(tokenizer))
        added = {i: tok for i, tok in tokenizer.added_tokens_decoder.items()}
        self.added = frozenset(added)  # ids of added and special tokens
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.bytes_of = [added[i].content.encode() if i in added else piece_bytes(p or "", self.family)
                         for i, p in enumerate(pieces)]

    def pieces(self, ids: list[int]) -> list[bytes]:
        """Each id's bytes (a special token's: its content)."""
        return [self.bytes_of[i] for i in ids]


def valid_utf8_prefix(data: bytes) -> str:
    """The longest prefix of `data` that is valid UTF-8, as text (a sampled completion may end
    inside a character, or hold a byte sequence no encoder would write)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        return data[: err.start].decode("utf-8")


def byte_offsets(text: str, char_offsets: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Character offsets → byte offsets (starts, ends) in `text`'s UTF-8; ends made non-decreasing."""
    at = [0, *accumulate(len(ch.encode()) for ch in text)]
    starts = [at[s] for s, _ in char_offsets]
    ends = list(accumulate((at[e] for _, e in char_offsets), max)) if char_offsets else []
    return starts, ends


def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[int], list[int]]:
    """`text` as `tokenizer` splits it (no special tokens added; those written in the text are
    parsed, as the tokenizer does everywhere): the ids and each token's byte start and end."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts, ends = byte_offsets(text, [tuple(o) for o in encoded["offset_mapping"]])
    return list(encoded["input_ids"]), starts, ends


def same_tokenizer(a, b) -> bool:
    """The same vocabulary, normaliser, pre-tokenizer and model (merges): any text splits into the
    same ids on both sides. Chat templates are not compared (each side renders its own prompt)."""
    if a.get_vocab() != b.get_vocab():
        return False
    if not (getattr(a, "is_fast", False) and getattr(b, "is_fast", False)):
        return type(a) is type(b)
    spec_a, spec_b = backend_spec(a), backend_spec(b)
    return all(spec_a.get(k) == spec_b.get(k) for k in ("normalizer", "pre_tokenizer", "model"))


def describe(tokenizer) -> str:
    """A short description for the start-up line: where it was loaded from, size, decoder family."""
    try:
        family = decoder_family(backend_spec(tokenizer))
    except UserError:
        family = "slow"
    name = str(getattr(tokenizer, "name_or_path", "") or "").rstrip("/").rsplit("/", 1)[-1]
    return f"{name or type(tokenizer).__name__}, {len(tokenizer):,} tokens, {family}"
