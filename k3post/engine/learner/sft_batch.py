"""Tokenising SFT examples into the learner's TrainBatch: the prompt through the chat template,
the reply as the completion (its tokens plus the end-of-turn token carry the loss)."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from k3post.data.sft import split_reply
from k3post.types import Prompt, TrainBatch, pad_right


def sft_batch(tokenizer: PreTrainedTokenizerBase, examples: list[Prompt], max_completion_tokens: int) -> TrainBatch:
    prompt_ids, completions = [], []
    for example in examples:
        context, reply = split_reply(example.messages)
        ids = tokenizer.apply_chat_template(context, add_generation_prompt=True, tokenize=True)
        prompt_ids.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"][: max_completion_tokens - 1]
        completions.append(torch.tensor(reply_ids + [tokenizer.eos_token_id], dtype=torch.long)[None])
    width = max(c.shape[1] for c in completions)
    completion_ids_BT = pad_right(completions, width, tokenizer.pad_token_id)
    loss_mask_BT = pad_right([torch.ones_like(c, dtype=torch.float) for c in completions], width)
    zeros_BT = torch.zeros_like(loss_mask_BT)
    return TrainBatch(prompt_ids, completion_ids_BT, loss_mask_BT, zeros_BT, zeros_BT)
