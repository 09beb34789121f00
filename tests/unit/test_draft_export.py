"""The draft head for serving: a `draft.hidden: residual` head, `k3post export-draft` (a MiMo
checkpoint vLLM's `mtp` method serves) and `k3post export-fp8` carrying the head.

The MiMo MTP layer is computed here from the exported file with transformers' Qwen2 modules, as
`vllm/model_executor/models/mimo_mtp.py` computes it (embedding zeroed at position 0,
input_proj over [hidden_layernorm(h̃); token_layernorm(e)], a Qwen2 decoder layer, final_layernorm),
and must equal the k3post head on the same inputs; the exported target must equal the student.
tests/vllm/test_vllm_mtp_export.py serves the export with vLLM itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

from k3post.cli.main import main
from k3post.config.draft_schema import DraftSpec, SpeculateSpec
from k3post.config.schema import ModelSpec, OptimSpec, TinyModelSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.model.generation.draft_head import MtpHead, residual_stream
from k3post.model.export.mimo_export import MTP_PREFIX, mimo_problem, write_mimo_checkpoint
from tests.unit.test_learner import make_batch

SPEC = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3, init_std=0.2))


def trained(tmp_path: Path, hidden: str = "residual", spec: ModelSpec = SPEC) -> tuple[Learner, Path]:
    """A learner whose head (and student) took two steps, and its checkpoint."""
    lrn = Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=1e-2, micro_batch_size=2), total_steps=10,
                                num_threads=2, draft=DraftSpec(kind="mtp", lr=1e-2, hidden=hidden)))
    for seed in range(2):
        lrn.train_step(make_batch(spec, n=4, seed=seed))
    lrn.save_checkpoint(str(tmp_path / "ckpt"), {})
    return lrn, tmp_path / "ckpt"


@pytest.fixture(scope="module")
def residual_run(tmp_path_factory) -> tuple[Learner, Path]:
    """One residual-head run shared by the tests that only read it."""
    return trained(tmp_path_factory.mktemp("residual"))


def residual_states(model, ids_BL: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), residual_stream(model):
        return model.model(input_ids=ids_BL).last_hidden_state


@torch.no_grad()
def mimo_mtp_layer(directory: Path, h_BLH, next_BL, positions_BL) -> torch.Tensor:
    """vLLM's MiMo MTP layer, from the exported tensors, with transformers' Qwen2 modules."""
    config = Qwen2Config.from_pretrained(directory)
    config._attn_implementation = "eager"  # standalone layers: the mask below is what they get
    state = load_file(directory / "model.safetensors")
    mtp = {k[len(MTP_PREFIX):]: v for k, v in state.items() if k.startswith(MTP_PREFIX)}

    def rms(name, x):
        norm = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps)
        norm.weight.copy_(mtp[f"{name}.weight"])
        return norm(x)

    layer = Qwen2DecoderLayer(config, 0)
    block = {k: v for k, v in mtp.items() if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                                 "post_attention_layernorm")}
    layer.load_state_dict(block, strict=True)
    e = state["model.embed_tokens.weight"][next_BL]
    e = torch.where(positions_BL[..., None] == 0, 0.0, e)  # "masking inputs at position 0, as not needed by MTP"
    x = F.linear(torch.cat([rms("hidden_layernorm", h_BLH), rms("token_layernorm", e)], -1), mtp["input_proj.weight"])
    mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                              position_ids=positions_BL)
    rotary = Qwen2RotaryEmbedding(config)(x, positions_BL)
    g = layer(x, attention_mask=mask, position_ids=positions_BL, position_embeddings=rotary)
    return rms("final_layernorm", g[0] if isinstance(g, tuple) else g)


def test_the_export_is_the_student_and_its_head_as_vllms_mimo_layer_computes_them(tmp_path, residual_run):
    lrn, _ = residual_run
    model, head = lrn.model.eval(), lrn.draft.head
    write_mimo_checkpoint(model, head.state_dict(), None, tmp_path / "mimo")
    ids_BL = torch.tensor([[5, 17, 3, 9, 11, 40, 2, 8]])
    positions_BL = torch.arange(ids_BL.shape[1] - 1)[None]
    h_BLH = residual_states(model, ids_BL)
    with torch.no_grad():
        ours = head(h_BLH[:, :-1], ids_BL[:, 1:], positions_BL)
        target = Qwen2ForCausalLM.from_pretrained(tmp_path / "mimo").eval()(input_ids=ids_BL).logits
    theirs = mimo_mtp_layer(tmp_path / "mimo", h_BLH[:, :-1], ids_BL[:, 1:], positions_BL)
    assert (ours - theirs).abs().max() < 1e-5
    assert torch.allclose(head.logits(ours[0]), head.logits(theirs[0]), atol=1e-4)
    # The target: a Llama student written as Qwen2 (zero q/k/v biases) computes the same logits.
    with torch.no_grad():
        assert (target - model(input_ids=ids_BL).logits).abs().max() < 1e-5
    # Position 0's embedding (of x_1) is zeroed: changing x_1 changes nothing; changing x_2 changes
    # position 1 and, through the head's attention, every later one.
    for column, changes in ((1, False), (2, True)):
        other = ids_BL.clone()
        other[0, column] = 30
        with torch.no_grad():
            moved = head(h_BLH[:, :-1], other[:, 1:], positions_BL)
        assert torch.equal(moved[:, 0], ours[:, 0])
        assert all(torch.equal(moved[:, t], ours[:, t]) != changes for t in range(1, moved.shape[1]))


def test_a_residual_head_trains_on_the_states_before_the_final_norm(residual_run):
    """The learner's capture is the norm's input; the head's loss target is still the student's
    own distribution (its norm applied), so a copy of that state fed back predicts as the student."""
    lrn, _ = residual_run
    ids_BL = torch.tensor([[5, 17, 3, 9]])
    captured = {}
    norm = lrn.model.model.norm

    def keep_input(module, args, output) -> None:
        captured["pre"] = args[0].detach()

    handle = norm.register_forward_hook(keep_input)
    with torch.no_grad():
        normed = lrn.model.model(input_ids=ids_BL).last_hidden_state
    handle.remove()
    pre = residual_states(lrn.model, ids_BL)
    assert torch.equal(pre, captured["pre"]) and not torch.allclose(pre, normed)
    assert torch.allclose(lrn.draft.head.student_logits(pre[0]), lrn.model(input_ids=ids_BL).logits[0], atol=1e-5)
    assert lrn.model.model.norm is norm  # the norm is back after residual_stream


def test_the_hf_sampler_drafts_with_a_residual_head_and_stays_greedy():
    from k3post.engine.samplers.speculative_sampler import Speculation
    from k3post.model.loading.load import load_model
    from k3post.model.generation.sampling import sample_completions
    from k3post.types import SamplingParams

    model, tokenizer = load_model(SPEC)
    prompts = [[1, 5, 9], [2, 7], [4, 4, 4, 8]]
    params = SamplingParams(10, 1e-4, 1.0, seed=0)
    speculation = Speculation(model, tokenizer, tokens=2, min_accept=0.0, hidden="residual")
    out = speculation.complete(prompts, params)
    plain = sample_completions(model, tokenizer, prompts, params)
    assert torch.equal(out.completion_ids_BT, plain.completion_ids_BT)
    assert speculation.last["rollout/draft_proposed"] > 0
    assert model.model.norm.__class__.__name__ != "Identity"


def test_export_draft_writes_a_mimo_checkpoint_and_says_how_to_serve_it(tmp_path, capsys):
    """From a bfloat16 run: the export stays in bfloat16."""
    _, ckpt = trained(tmp_path, spec=SPEC.model_copy(update={"dtype": "bfloat16"}))
    assert main(["export-draft", str(ckpt), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert '"method": "mtp"' in printed and "MiMoForCausalLM" in printed
    config = Qwen2Config.from_pretrained(tmp_path / "out")
    assert config.architectures == ["MiMoForCausalLM"] and config.num_nextn_predict_layers == 1
    assert config.dtype == torch.bfloat16
    state = load_file(tmp_path / "out" / "model.safetensors")
    head = load_file(ckpt / "mtp_head.safetensors")
    d = 32
    assert torch.equal(state[MTP_PREFIX + "input_proj.weight"][:, :d], head["eh_proj.weight"][:, d:])
    assert torch.equal(state[MTP_PREFIX + "final_layernorm.weight"], state["model.norm.weight"])
    assert not state[MTP_PREFIX + "self_attn.q_proj.bias"].any()  # Llama has none: zeros
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()


def test_export_draft_refuses_a_head_that_reads_the_normed_state(tmp_path, capsys):
    _, ckpt = trained(tmp_path, hidden="final_norm")
    assert main(["export-draft", str(ckpt), str(tmp_path / "out")]) == 2
    assert "draft.hidden: residual" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, words", [
    (LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32), "head_dim 32"),
    (LlamaConfig(hidden_size=64, num_attention_heads=4, attention_bias=True), "o_proj bias"),
    (LlamaConfig(hidden_size=64, num_attention_heads=4, hidden_act="gelu"), "SiLU"),
    (Qwen2Config(hidden_size=64, num_attention_heads=4, use_sliding_window=True, sliding_window=16), "sliding_window"),
])
def test_students_without_an_exact_qwen2_form_are_refused(config, words):
    assert words in mimo_problem(config)
    assert mimo_problem(LlamaConfig(hidden_size=64, num_attention_heads=4)) is None


def test_export_fp8_carries_the_head_in_the_checkpoints_dtype(tmp_path, capsys, residual_run):
    _, ckpt = residual_run
    assert main(["export-fp8", str(ckpt), str(tmp_path / "fp8"), "--nll-replies", "0"]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "fp8" / "mtp_head.safetensors").read_bytes() == (ckpt / "mtp_head.safetensors").read_bytes()
    assert "draft head: mtp_head.safetensors" in printed and "kept in f32" in printed
    assert "draft head: mtp_head.safetensors" in (tmp_path / "fp8" / "README.md").read_text()


def test_the_speculating_learner_sends_a_residual_head_like_any_other():
    lrn = Learner(LearnerConfig(student=SPEC, optim=OptimSpec(lr=1e-2, micro_batch_size=2), total_steps=10,
                                num_threads=2, draft=DraftSpec(kind="mtp", hidden="residual",
                                                               speculate=SpeculateSpec(tokens=2))))
    assert {"mtp.eh_proj.weight", "mtp.enorm.weight"} <= set(lrn.weights())
    assert isinstance(lrn.draft.head, MtpHead) and lrn.draft.head.hidden == "residual"


def test_a_damaged_head_shard_is_found_before_resume(tmp_path, residual_run):
    import shutil

    from k3post.track.checkpoint_files import checkpoint_problem

    ckpt = Path(shutil.copytree(residual_run[1], tmp_path / "ckpt"))
    assert checkpoint_problem(ckpt) is None
    (ckpt / "COMPLETE").write_text("complete\n")  # a marker without a manifest: the format checks alone
    shard = next((ckpt / "mtp_dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    assert f"mtp_dcp/{shard.name} is cut short" in checkpoint_problem(ckpt)
