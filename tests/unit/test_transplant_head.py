"""The transplant's `head: chain` (model/tokenizers/transplant_head.py): a new token's logit is the old logit
of its first piece plus the old log-probability of the rest, the constant folded into the row
through a direction u with h·u ≈ 1."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from k3post.config.model_schema import ModelSpec, TransplantSpec
from k3post.model.tokenizers.transplant import build_transplanted, is_tied, map_tokens, transplant_embeddings
from k3post.model.tokenizers.transplant_head import chain_head_rows, constant_direction, continuation_logprobs
from tests.unit.test_transplant import WORLD, old_tokenizer, prompts, tiny_llama, train_bpe_tokenizer


def test_the_constant_direction_recovers_an_exact_one():
    """Hidden states built so that h·u* = 1 at every row: the fit finds u* (it is determined: more
    rows than dimensions) and gives 1 on rows it never saw."""
    torch.manual_seed(0)
    u_star = torch.randn(8, dtype=torch.float64)
    raw = torch.randn(300, 8, dtype=torch.float64)
    H = raw - ((raw @ u_star - 1) / u_star.dot(u_star))[:, None] * u_star[None]
    assert torch.allclose(H @ u_star, torch.ones(300, dtype=torch.float64))
    u = constant_direction(H[:200], ridge=1e-9)
    assert torch.allclose(u, u_star, atol=1e-6)
    assert torch.allclose(H[200:] @ u, torch.ones(100, dtype=torch.float64), atol=1e-6)


def test_continuations_equal_each_piece_list_scored_alone():
    """Batched and padded, the continuation of each list is the brute-force sum of log P(o_j | o_<j)
    over j ≥ 2 from one unpadded forward per list; lists of 0 or 1 ids give 0."""
    model = tiny_llama(50)
    pieces = [[5, 7, 9, 11], [3], [], [4, 4], [10, 20, 30, 40, 49, 1], [6, 8]]
    got = continuation_logprobs(model, pieces, pad_id=2, batch=2)
    for ids, value in zip(pieces, got):
        if len(ids) < 2:
            assert value == 0
            continue
        with torch.no_grad():
            logprobs = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
        want = sum(float(logprobs[j - 1, ids[j]]) for j in range(1, len(ids)))
        assert value.item() == pytest.approx(want, abs=1e-5)


def test_chain_rows_by_hand():
    """Row = old row of the first piece + continuation · u; no piece: the mean old row, no term."""
    old = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]])
    rows = chain_head_rows(old, [[1, 2], [0], [], [2, 0, 1]], torch.tensor([-2.0, 0.0, 0.0, -0.5]),
                           torch.tensor([0.5, 0.25]))
    assert torch.equal(rows, torch.tensor([[-1.0, 1.5], [1.0, 0.0], [4 / 3, 1.0], [2.75, 0.875]]))


def test_a_chain_transplant_has_its_own_head_and_loads_untied(tmp_path):
    """transplant_embeddings(head="chain"): input rows are still the means, the head is its own
    matrix (one-piece tokens: the old row, as their continuation is 0), saved and loaded untied."""
    old = old_tokenizer()
    new = train_bpe_tokenizer(prompts()[1::2] + WORLD * 20, 700, like=old)
    token_map = map_tokens(old, new)
    model = tiny_llama(len(old))
    old_rows = model.get_input_embeddings().weight.detach().clone()
    transplant_embeddings(model, old, new, token_map, head="chain", texts=prompts()[:40])
    assert not is_tied(model) and model.config.tie_word_embeddings is False
    head = model.get_output_embeddings().weight.detach()
    one = [t for t, ids in enumerate(token_map.old_ids) if len(ids) == 1]
    several = [t for t, ids in enumerate(token_map.old_ids) if len(ids) > 1]
    assert one and several
    assert torch.equal(head[one], old_rows[[token_map.old_ids[t][0] for t in one]])
    assert not torch.equal(head[several], old_rows[[token_map.old_ids[t][0] for t in several]])
    assert torch.equal(model.get_input_embeddings().weight[several[0]],
                       old_rows[token_map.old_ids[several[0]]].mean(0))
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not is_tied(again) and torch.equal(again.get_output_embeddings().weight, head)


def test_the_command_builds_a_chain_head(tmp_path, capsys):
    """`k3post transplant --head chain` writes a directory that loads untied and says what it did."""
    from tests.unit.test_transplant import run_cli  # noqa: PLC0415

    base = tmp_path / "base"
    tiny_llama(len(old_tokenizer())).save_pretrained(base)
    old_tokenizer().save_pretrained(base)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(prompts()[1::2] + WORLD * 20), encoding="utf-8")
    code, stdout, stderr = run_cli(capsys, tmp_path / "out", "--base", base, "--vocab-size", 500, "--corpus", corpus,
                                   "--head", "chain")
    assert code == 0, stderr
    assert "head: chain" in stderr and "vocabulary 420 -> 500 tokens" in stdout
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.tie_word_embeddings is False


def test_an_unknown_head_is_a_spec_error():
    with pytest.raises(ValueError, match="head"):
        TransplantSpec(base=ModelSpec(builtin="smollm2-135m-instruct"), head="mean")


KEEP = [*range(13), *range(19, 30)]  # recipes/distill/cross-tokenizer.yaml's 24-layer student


@pytest.mark.slow  # opt-in (K3POST_SLOW=1): builds two 12k transplants of the real SmolLM2 (~1-2 min)
def test_on_smollm2_the_chain_head_stops_digit_runs_taking_the_first_token(tmp_path):
    """The tied mean head gives the ~300 digit-run tokens of a 12k BPE the logit of an average
    digit: after a chat prompt they hold > 10% of the 24-layer pruned SmolLM2's first token; the
    chain head gives them < 5% (measured 16.5% and 1.8%)."""
    mass = {}
    for head in ("tied", "chain"):
        spec = TransplantSpec(base=ModelSpec(builtin="smollm2-135m-instruct", keep_layers=KEEP), vocab_size=12000,
                              head=head)
        build_transplanted(spec, tmp_path / head)
        from transformers import AutoTokenizer  # noqa: PLC0415

        tok = AutoTokenizer.from_pretrained(tmp_path / head)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / head).eval()
        digit = torch.tensor([bool(re.search(r"\d", tok.decode([i]))) for i in range(len(tok))])
        ids = tok.apply_chat_template([{"role": "user", "content": "Explain what a vaccine is in one sentence."}],
                                      add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            mass[head] = float(model(ids).logits[0, -1].softmax(-1)[digit].sum())
    assert mass["tied"] > 0.10 and mass["chain"] < 0.05, mass
