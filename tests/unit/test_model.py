"""Model layer: padding-invariant logprobs, sampler/learner parity, pruning, tiny tokenizer."""

from __future__ import annotations

import torch

from k3post.config.schema import ModelSpec, TinyModelSpec
from k3post.model.loading.load import load_model
from k3post.model.scoring.logprobs import completion_full_logprobs, completion_logprobs, pack_sequences
from k3post.model.loading.prune import keep_decoder_layers
from k3post.model.generation.sampling import completion_mask, render_prompts, sample_completions
from k3post.types import Prompt, SamplingParams


def prompts(n: int) -> list[Prompt]:
    texts = ["What is 2 + 2?", "Name a color.", "Say hi in one word, please, right now.", "Why?"]
    return [Prompt(f"u{i}", "s", "t", (("user", texts[i % len(texts)]),)) for i in range(n)]


def brute_force_logprobs(model, prompt_ids, completion_ids_BT, mask_BT):
    """One unpadded forward per row: the ground truth padding must not change."""
    out = torch.zeros(mask_BT.shape)
    for b, prompt in enumerate(prompt_ids):
        n = int(mask_BT[b].sum())
        ids = torch.tensor(prompt + completion_ids_BT[b, :n].tolist())[None]
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        for t in range(n):
            out[b, t] = logp[len(prompt) - 1 + t, completion_ids_BT[b, t]]
    return out


def test_pack_sequences_layout():
    ids, mask, cols = pack_sequences([[5, 6], [7]], torch.tensor([[1, 2, 3], [4, 0, 0]]),
                                     torch.tensor([[1.0, 1, 1], [1, 0, 0]]), pad_id=0)
    assert ids.tolist() == [[5, 6, 1, 2, 3], [7, 4, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert cols.tolist() == [[1, 2, 3], [0, 1, 2]]


def assert_logprobs_padding_invariant(model, tokenizer) -> None:
    """Right-padded learner logprobs == unpadded per-row forwards == the left-padded sampler's;
    chunking the head changes nothing."""
    ids = render_prompts(tokenizer, prompts(4))
    out = sample_completions(model, tokenizer, ids, SamplingParams(max_new_tokens=7, seed=1))
    with torch.no_grad():
        batched = completion_logprobs(model, ids, out.completion_ids_BT, out.loss_mask_BT, tokenizer.pad_token_id)
        chunked = completion_logprobs(model, ids, out.completion_ids_BT, out.loss_mask_BT, tokenizer.pad_token_id,
                                      chunk=3)
        truth = brute_force_logprobs(model, ids, out.completion_ids_BT, out.loss_mask_BT)
    assert torch.allclose(batched, truth, atol=1e-5)
    assert torch.allclose(chunked, batched, atol=1e-6)
    assert torch.allclose(out.logprobs_BT, batched, atol=1e-4)


def test_completion_logprobs_match_unpadded_forward_and_chunking(tiny_model):
    assert_logprobs_padding_invariant(*tiny_model)


def test_full_logprobs_gather_to_token_logprobs(tiny_model):
    model, tokenizer = tiny_model
    ids = render_prompts(tokenizer, prompts(3))
    out = sample_completions(model, tokenizer, ids, SamplingParams(max_new_tokens=5, seed=2))
    with torch.no_grad():
        full = completion_full_logprobs(model, ids, out.completion_ids_BT, out.loss_mask_BT, tokenizer.pad_token_id)
        tokens = completion_logprobs(model, ids, out.completion_ids_BT, out.loss_mask_BT, tokenizer.pad_token_id)
    gathered = full.gather(-1, out.completion_ids_BT[..., None]).squeeze(-1) * out.loss_mask_BT
    assert torch.allclose(gathered, tokens, atol=1e-5)
    assert torch.allclose(full.exp().sum(-1), torch.ones(full.shape[:2]), atol=1e-4)


def test_temperature_scales_logits(tiny_model):
    model, tokenizer = tiny_model
    ids = render_prompts(tokenizer, prompts(2))
    comp = torch.tensor([[10, 11], [12, 13]])
    mask = torch.ones(2, 2)
    with torch.no_grad():
        full = completion_full_logprobs(model, ids, comp, mask, tokenizer.pad_token_id)
        hot = completion_logprobs(model, ids, comp, mask, tokenizer.pad_token_id, temperature=2.0)
    expected = torch.log_softmax(full / 2.0, -1).gather(-1, comp[..., None]).squeeze(-1)  # log_softmax is shift-invariant
    assert torch.allclose(hot, expected, atol=1e-5)


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[3, 9, 4, 9], [9, 9, 9, 9], [1, 2, 3, 4]])
    assert completion_mask(ids, [9]).tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_keep_all_layers_is_identity_and_pruned_model_decodes_with_cache():
    spec = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=4, seed=5))
    full, tokenizer = load_model(spec)
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        reference = full(input_ids=x).logits
        pruned = keep_decoder_layers(load_model(spec)[0], [0, 1, 2, 3])
        assert torch.equal(pruned(input_ids=x).logits, reference)
        small = keep_decoder_layers(load_model(spec)[0], [0, 3])
        assert small.config.num_hidden_layers == 2
        assert [layer.self_attn.layer_idx for layer in small.model.layers] == [0, 1]
        assert not torch.allclose(small(input_ids=x).logits, reference)
        # Cached decoding through the renumbered layers equals the full forward.
        out = small.generate(input_ids=x, max_new_tokens=4, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        recomputed = small(input_ids=out.sequences).logits[0, x.shape[1] - 1:-1]
        assert torch.allclose(torch.stack(out.logits, 1)[0], recomputed, atol=1e-5)


def test_keep_layers_out_of_range_is_a_user_error():
    import pytest

    from k3post.config.errors import UserError

    model, _ = load_model(ModelSpec(tiny=TinyModelSpec(num_layers=2)))
    with pytest.raises(UserError, match=r"layers 0\.\.1"):
        keep_decoder_layers(model, [0, 2])


def test_tiny_tokenizer_round_trip_and_chat_template(tiny_model):
    _, tokenizer = tiny_model
    text = "What is 7 + 5? It's 12."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    ids = render_prompts(tokenizer, prompts(1), system_prompt="Be brief.")[0]
    rendered = tokenizer.decode(ids)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>") and rendered.endswith("assistant\n")


def test_hf_directory_loads_like_the_tiny_spec(tmp_path, tiny_spec):
    from k3post.model.loading.tiny import save_tiny

    save_tiny(tiny_spec.tiny, tmp_path / "m")
    a, _ = load_model(tiny_spec)
    b, tok = load_model(ModelSpec(path=str(tmp_path / "m")))
    x = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(a(input_ids=x).logits, b(input_ids=x).logits)
    assert tok.chat_template


def test_weight_sync_sends_tied_storage_once_and_applies_everything():
    import pytest

    from k3post.model.training.weights import export_weights, import_weights

    a, _ = load_model(ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=1)))
    b, _ = load_model(ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=2)))
    weights = export_weights(a)
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights  # tied: sent once
    import_weights(b, weights)
    x = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(a(input_ids=x).logits, b(input_ids=x).logits)
    assert b.lm_head.weight.data_ptr() == b.model.embed_tokens.weight.data_ptr()  # still tied
    partial = dict(weights)
    partial.pop("model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"):
        import_weights(b, partial)


def test_the_compiled_head_gives_the_eager_logprobs_and_gradients():
    """`train.compile` compiles the head's chunks (model/scoring/logprobs.py): the same log-softmax values
    and gradients as the eager chunks and as one log_softmax over all positions, with a last chunk
    of another length (dynamic shapes) and a temperature that is not 1."""
    from k3post.model.scoring.logprobs import head_logprobs

    gen = torch.Generator().manual_seed(0)
    h_NH, w_VH = torch.randn(37, 8, generator=gen), torch.randn(50, 8, generator=gen)
    targets_N = torch.randint(0, 50, (37,), generator=gen)
    results = []
    for compiled in (False, True):
        h, w = h_NH.clone().requires_grad_(), w_VH.clone().requires_grad_()
        values = head_logprobs(h, w, targets_N, temperature=0.7, chunk=16, compiled=compiled)
        values.sum().backward()
        results.append((values.detach(), h.grad, w.grad))
    truth = torch.log_softmax(h_NH @ w_VH.T / 0.7, -1).gather(-1, targets_N[:, None]).squeeze(-1)
    (eager, eager_dh, eager_dw), (comp, comp_dh, comp_dw) = results
    assert torch.allclose(eager, truth, atol=1e-5) and torch.allclose(comp, truth, atol=1e-5)
    assert torch.allclose(comp_dh, eager_dh, atol=1e-5) and torch.allclose(comp_dw, eager_dw, atol=1e-5)
