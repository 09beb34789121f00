"""The FP8 export: the exported weights are exactly QAT's fake-quantized weights, and the
checkpoint loads through transformers' compressed-tensors integration with the same outputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from k3post.config.schema import ModelSpec, TinyModelSpec
from k3post.model.export.fp8_export import dequantize_rows_fp8, export_fp8, quantize_rows_fp8
from k3post.model.loading.load import load_model
from k3post.model.quant.qat import prepare_fp8_qat

SPEC = ModelSpec(tiny=TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, seed=4, init_std=0.05))
X = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def test_row_quantization_matches_torchao_fake_quant_bit_for_bit():
    model, _ = load_model(SPEC)
    prepare_fp8_qat(model)
    for layer in (model.model.layers[0].self_attn.q_proj, model.model.layers[1].mlp.down_proj):
        q, scale = quantize_rows_fp8(layer.weight.detach())
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (layer.out_features, 1)
        assert torch.equal(dequantize_rows_fp8(q, scale), layer.weight_fake_quantizer(layer.weight).detach())


def test_zero_rows_stay_zero():
    q, scale = quantize_rows_fp8(torch.zeros(3, 16))
    assert torch.equal(dequantize_rows_fp8(q, scale), torch.zeros(3, 16)) and torch.isfinite(scale).all()


def test_export_loads_in_transformers_and_matches_the_qat_forward(tmp_path):
    model, tokenizer = load_model(SPEC)
    prepare_fp8_qat(model)
    counts = export_fp8(model, tokenizer, tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "float-quantized"
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["dynamic"] is True
    assert config["ignore"] == ["lm_head"] and counts == {"fp8_layers": 14, "kept_layers": 1}
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    with torch.no_grad():
        qat = model(input_ids=X).logits
        fp8 = served(input_ids=X).logits
    # The numerics allow ~1e-2 relative per layer between fake quant and real FP8 kernels; on
    # CPU transformers runs the same emulation, so it is exact here.
    assert ((qat - fp8).norm() / qat.norm()) < 1e-2


def test_export_command(tmp_path, capsys):
    from k3post.cli.main import main
    from k3post.model.loading.tiny import save_tiny

    save_tiny(SPEC.tiny, tmp_path / "ckpt")
    result = subprocess.run([sys.executable, "-m", "k3post.cli.main", "export-fp8", str(tmp_path / "ckpt"),
                             str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "14 Linear layers in FP8" in result.stdout
    lines = result.stdout.splitlines()
    row = lambda kind: next(line.split() for line in lines if line.split()[:1] == [kind])  # noqa: E731
    assert row("self_attn.q_proj")[1:3] == ["2", "8,192"] and "FP8" in row("self_attn.q_proj")  # 2 layers of 64×64
    assert row("embed_tokens")[-2:] == ["float32", "(kept)"]
    assert any(line.strip().startswith("held-out NLL (32 replies of builtin:reference") for line in lines)
    assert "warning: it has no k3post model card" in result.stdout
    card = (tmp_path / "out" / "README.md").read_text()
    assert "## What the export changed" in card and "self_attn.q_proj" in card and "held-out NLL" in card
    # A missing checkpoint: one located line, no traceback (the CLI's error path, in this process:
    # the command above already ran the real executable).
    capsys.readouterr()
    assert main(["export-fp8", str(tmp_path / "nope"), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err


def test_the_report_says_whether_qat_trained_the_checkpoint():
    from k3post.cli.export import qat_trained, qat_warning

    card = "---\ntags:\n- k3post\n{}---\n# card\n"
    assert qat_trained(card.format("- fp8-qat\n")) is True and qat_warning(True) is None
    assert qat_trained(card.format("")) is False and "trained without FP8 QAT" in qat_warning(False)
    assert qat_trained(None) is None and "no k3post model card" in qat_warning(None)


def test_the_heldout_nll_change_is_the_paired_difference_of_the_two_nlls(tmp_path):
    """Closed form: Δ = NLL(export) − NLL(source) over the same replies; an export of a model whose
    weights FP8 represents exactly (zero weights) changes nothing."""
    from k3post.engine.evaluation.fp8_check import heldout_nll_change
    from k3post.model.loading.tiny import save_tiny

    save_tiny(SPEC.tiny, tmp_path / "ckpt")
    model, tokenizer = load_model(ModelSpec(path=str(tmp_path / "ckpt")))
    export_fp8(model, tokenizer, tmp_path / "fp8")
    change = heldout_nll_change(tmp_path / "ckpt", tmp_path / "fp8", replies=8)
    assert change.replies == 8 and change.tokens > 0
    assert change.change.value == pytest.approx(change.fp8 - change.source, abs=1e-9)
    assert change.change.low <= change.change.value <= change.change.high and change.change.value != 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.zero_()
    model.save_pretrained(tmp_path / "zero")
    tokenizer.save_pretrained(tmp_path / "zero")
    export_fp8(model, tokenizer, tmp_path / "zero-fp8")
    same = heldout_nll_change(tmp_path / "zero", tmp_path / "zero-fp8", replies=8)
    assert abs(same.change.value) < 1e-6 and same.change.high - same.change.low < 1e-6
