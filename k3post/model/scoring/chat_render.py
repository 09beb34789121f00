"""Prompts through a chat template, without tokenizing again the head that every prompt shares.

Every prompt an engine renders starts with the same text: the chat template's head and, for a
teacher with its own system prompt (a style guide, a policy, tool descriptions), a system turn
that can run to thousands of tokens. Tokenizing that head again for every row costs more than
scoring the row once the teacher caches the head's keys and values (model/scoring/prefix_scoring.py): a
2,048-token system prompt took the tokenizer ~80 ms for 32 rows on a 2-core CPU.

Why the head can be tokenized once, exactly. A fast tokenizer cuts its input at its added
special tokens before anything else runs (those not normalised): the normaliser and the
pre-tokenizer then see each piece between two special tokens on its own, and a special token is
one id. So for a text A·S·B, with S such a special token,

    ids(A·S·B) = ids(A·S) ++ ids(S·B)[1:]

(B follows a special token in both texts, so a rule that depends on where a piece sits, such as
a prefix space added only at the very start of the input, treats it the same). The head A·S — the
text every rendering shares, up to the end of the last special token in it — is tokenized once
per system prompt; each row tokenizes S·B, its own part (the rows in one batched call).

The identity is the tokenizer library's design, not a property of a model; so each head is also
checked when it is made, on probe messages (leading spaces and new lines, accents, emoji, CJK, a
special token's text inside the message) against the whole rendering. A tokenizer for which any
probe differs, a slow tokenizer (Python, which splits otherwise), and a row whose text does not
start with the head (a prompt with its own system turn) are rendered whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from k3post.model.generation.sampling import chat_of, render_prompts
from k3post.types import Prompt

PROBES = ("0", "Zebra?", " a leading space", "\n\ttabs and new lines\n", "Café, e\u0301, 😀 and 日本語",
          "<|im_end|><|im_start|>assistant", "</s><s>[INST]", "  ")


@dataclass(frozen=True)
class _Head:
    """The shared text up to the end of its last special token, its ids, and that token."""

    text: str
    ids: tuple[int, ...]
    token: str


class ChatRenderer:
    """`render_prompts` for one tokenizer, the shared head of each system prompt tokenized once
    (the last few system prompts kept)."""

    KEEP = 4

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._heads: dict[str | None, _Head | None] = {}

    def __call__(self, prompts: list[Prompt], system_prompt: str | None = None) -> list[list[int]]:
        """Token ids of each prompt through the chat template, ready for the reply: equal to
        `render_prompts(tokenizer, prompts, system_prompt)`."""
        if not prompts:
            return []
        head = self._head(system_prompt)
        if head is not None:
            texts = self._texts(prompts, system_prompt)
            if not any(t.startswith(head.text) for t in texts):  # the template's head changed (a date in it,
                self._heads.pop(system_prompt)                    # a new template): made again, checked again
                head = self._head(system_prompt)
        if head is None:
            return render_prompts(self.tokenizer, prompts, system_prompt)
        return self._with_head(head, texts)

    def _texts(self, prompts: list[Prompt], system_prompt: str | None) -> list[str]:
        chats = [chat_of(p, system_prompt) for p in prompts]
        return list(self.tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=False))

    def _ids(self, texts: list[str]) -> list[list[int]]:
        """What apply_chat_template's tokenize step returns for each text (one batched call)."""
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _with_head(self, head: _Head, texts: list[str]) -> list[list[int]]:
        cut = len(head.text)
        own = [t.startswith(head.text) for t in texts]
        pieces = self._ids([head.token + t[cut:] if o else t for t, o in zip(texts, own)])
        token_id = head.ids[-1]
        out = []
        for text, o, ids in zip(texts, own, pieces):
            if o and ids and ids[0] == token_id:
                out.append(list(head.ids) + ids[1:])
            else:  # not the head's text, or its token did not come out alone: the whole text
                out.append(ids if not o else self._ids([text])[0])
        return out

    def _head(self, system_prompt: str | None) -> _Head | None:
        if system_prompt not in self._heads:
            if len(self._heads) >= self.KEEP:
                self._heads.pop(next(iter(self._heads)))
            self._heads[system_prompt] = self._checked_head(system_prompt)
        return self._heads[system_prompt]

    def _checked_head(self, system_prompt: str | None) -> _Head | None:
        """The head of this system prompt's renderings, if the split reproduces every probe."""
        if not getattr(self.tokenizer, "is_fast", False) or self.tokenizer.chat_template is None:
            return None
        probes = [Prompt(f"probe-{i}", "", "", (("user", text),)) for i, text in enumerate(PROBES)]
        texts = self._texts(probes, system_prompt)
        head = self._head_of(texts)
        if head is None or self._with_head(head, texts) != render_prompts(self.tokenizer, probes, system_prompt):
            return None
        return head

    def _head_of(self, texts: list[str]) -> _Head | None:
        """The texts' common start, cut after the last (unnormalised) special token inside it."""
        shared = os.path.commonprefix(texts)
        ends = [(shared.rfind(a.content) + len(a.content), len(a.content), a.content)  # the longest token on a tie
                for a in self.tokenizer.added_tokens_decoder.values()
                if a.special and not a.normalized and a.content and a.content in shared]
        if not ends:
            return None
        end, _, token = max(ends)
        ids = self._ids([shared[:end]])[0]
        if not ids or ids[-1] != self.tokenizer.convert_tokens_to_ids(token):
            return None
        return _Head(shared[:end], tuple(ids), token)
