"""Tokenizer transplant (model/tokenizers/transplant.py): each new token's embedding is the mean of the old
rows of its text as the old tokenizer splits it, the head stays tied, the directory loads and
generates, the spec is cached and strict, the CLI names bad input."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

from k3post.cli.main import main
from k3post.config.errors import UserError
from k3post.config.model_schema import ModelSpec, TinyModelSpec, TransplantSpec
from k3post.config.recipe_files import absolute_model_paths
from k3post.data.builtin_prompts import builtin_prompt_set
from k3post.model.tokenizers import transplant
from k3post.model.loading.load import load_model
from k3post.model.tokenizers.token_text import byte_alphabet
from k3post.model.tokenizers.transplant import (build_transplanted, byte_splitter, map_tokens, mean_rows, train_bpe_tokenizer,
                                     transplant_embeddings)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
WORLD = ["Café, naïve façade — déjà vu über Straße.", "東京は日本の首都です。中文测试，你好世界。",
         "Emoji: 😀 🎉 👍🏽 and ❤️ — “quotes” … done.", "Tabs\tand\nnew lines\n\n  indented   spaces  "]
ROUND_TRIP = [*WORLD, "ÀÉÎÕÜ àéîõü ñ ç ø å", "a\r\nb", "<|im_start|>user\nhi<|im_end|>", " lead and trail ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]


def prompts() -> list[str]:
    return [row["prompt"] for name in ("chat", "math") for row in builtin_prompt_set(name)]


def old_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE built with `tokenizers` directly (not the code under test)."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(prompts()[::2], trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def tiny_llama(vocab: int, tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=tied, bos_token_id=1,
        eos_token_id=2, pad_token_id=2)).eval()


@pytest.fixture(scope="module")
def old():
    return old_tokenizer()


@pytest.fixture(scope="module")
def new(old):
    return train_bpe_tokenizer(prompts()[1::2] + WORLD * 20, 700, like=old)


@pytest.fixture(scope="module")
def transplanted(old, new):
    model = tiny_llama(len(old))
    old_rows = model.get_input_embeddings().weight.detach().clone()
    transplant_embeddings(model, old, new)
    return model, old_rows, model.get_input_embeddings().weight.detach()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, old) -> Path:
    directory = tmp_path_factory.mktemp("base")
    tiny_llama(len(old)).save_pretrained(directory)
    old.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(prompts()[1::2] + WORLD * 20), encoding="utf-8")
    return path


def token_bytes(token: str) -> bytes:
    return bytes(byte_alphabet()[c] for c in token)


def test_trained_tokenizer_is_byte_level_like_its_model_and_deterministic(old, new):
    again = train_bpe_tokenizer(prompts()[1::2] + WORLD * 20, 700, like=old)
    assert again.backend_tokenizer.to_str() == new.backend_tokenizer.to_str()
    assert len(new) == 700 and new.convert_ids_to_tokens([0, 1, 2]) == SPECIALS
    assert all(new.added_tokens_decoder[i].special for i in range(3))
    assert (new.eos_token, new.bos_token, new.pad_token, new.unk_token) == (
        old.eos_token, old.bos_token, old.pad_token, old.unk_token)
    assert new.chat_template == TEMPLATE
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(new.get_vocab())


def test_a_base_that_adds_bos_gets_a_tokenizer_that_adds_it(old):
    like = old_tokenizer()
    like.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", like.convert_tokens_to_ids("<|im_start|>"))])
    assert old("hi")["input_ids"][0] != old.bos_token_id and like("hi")["input_ids"][0] == like.bos_token_id
    new = train_bpe_tokenizer(prompts()[:50], 400, like=like)
    ids = new("hi there")["input_ids"]
    assert ids[0] == new.bos_token_id and new.decode(ids[1:]) == "hi there"
    assert train_bpe_tokenizer(prompts()[:50], 400, like=old)("hi")["input_ids"][0] != new.bos_token_id


def test_vocab_size_below_bytes_and_specials_is_a_user_error(old):
    with pytest.raises(UserError, match=r"vocab_size 200 is too small.*256 byte tokens \+ 3 special.*>= 259"):
        train_bpe_tokenizer(["abc"], 200, like=old)


def test_mean_rows_is_the_mean_and_empty_rows_the_average_token():
    rows = torch.randn(6, 4)
    out = mean_rows(rows, [[3], [1, 2, 2], [], [5, 0]])
    assert torch.equal(out[0], rows[3])
    torch.testing.assert_close(out[1], (rows[1] + 2 * rows[2]) / 3)
    torch.testing.assert_close(out[2], rows.mean(0))
    torch.testing.assert_close(out[3], (rows[5] + rows[0]) / 2)


def test_every_new_row_is_the_mean_of_its_old_pieces(old, new, transplanted):
    """Brute force: each regular token's text encoded by the old tokenizer, its rows averaged."""
    _, old_rows, new_rows = transplanted
    single = multi = 0
    for i in range(3, len(new)):
        raw = token_bytes(new.convert_ids_to_tokens(i))
        try:
            ids = old.encode(raw.decode("utf-8"), add_special_tokens=False)
        except UnicodeDecodeError:  # a fragment of a character: the old byte-level BPE on its bytes
            ids = [t.id for t in old.backend_tokenizer.model.tokenize(new.convert_ids_to_tokens(i))]
        if len(ids) == 1:
            single += 1
            assert torch.equal(new_rows[i], old_rows[ids[0]]), new.convert_ids_to_tokens(i)
        else:
            multi += 1
            torch.testing.assert_close(new_rows[i], old_rows[ids].mean(0), rtol=0, atol=1e-6)
    assert single > 200 and multi > 100  # both kinds are exercised


def test_character_fragments_and_specials(old, new, transplanted):
    _, old_rows, new_rows = transplanted
    fragments = [i for i in range(3, len(new)) if not is_utf8(token_bytes(new.convert_ids_to_tokens(i)))]
    assert any(len(token_bytes(new.convert_ids_to_tokens(i))) > 1 for i in fragments), "merges of character parts"
    for i in fragments:  # the old byte-level BPE run on the fragment's bytes
        ids = [t.id for t in old.backend_tokenizer.model.tokenize(new.convert_ids_to_tokens(i))]
        torch.testing.assert_close(new_rows[i], old_rows[ids].mean(0), rtol=0, atol=1e-6)
    for token in SPECIALS:
        assert torch.equal(new_rows[new.convert_tokens_to_ids(token)], old_rows[old.convert_tokens_to_ids(token)])
    same = next(t for t in ("Ġthe", "Ġa", "Ġis") if t in old.get_vocab() and t in new.get_vocab())
    assert torch.equal(new_rows[new.convert_tokens_to_ids(same)], old_rows[old.convert_tokens_to_ids(same)])


def is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_sentencepiece_style_new_tokenizer_maps_by_its_text(old):
    """'▁' is a space for a Metaspace tokenizer: '▁the' averages the old pieces of ' the'."""
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer, core.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    core.train_from_iterator(prompts(), trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIALS],
                                                            show_progress=False))
    new = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>")
    token_map = map_tokens(old, new)
    present = [piece for piece in ("▁the", "▁a", "▁is") if piece in new.get_vocab()]
    assert present
    for piece in present:
        assert token_map.old_ids[new.convert_tokens_to_ids(piece)] == old.encode(piece.replace("▁", " "))
    assert token_map.old_ids[0] == [] and token_map.special[0]  # <unk>: a special the old side lacks
    assert token_map.old_ids[new.convert_tokens_to_ids("<|im_end|>")] == [old.convert_tokens_to_ids("<|im_end|>")]


def test_bytes_the_old_vocabulary_lacks_split_the_fragment():
    """A byte-level BPE without a byte (never seen in training) would drop it and merge across
    the gap: ' th' + <missing> + 'e' must not become ' the'."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    core.train_from_iterator(prompts(), trainers.BpeTrainer(vocab_size=400, show_progress=False))  # ASCII only
    ascii_old = PreTrainedTokenizerFast(tokenizer_object=core)
    assert "Ġthe" in ascii_old.get_vocab() and byte_alphabet_char(0xFF) not in ascii_old.get_vocab()
    ids = byte_splitter(ascii_old)(b" th\xffe")
    bpe = ascii_old.backend_tokenizer.model
    assert ids == [t.id for t in bpe.tokenize("Ġth")] + [t.id for t in bpe.tokenize("e")]
    assert ids != [ascii_old.convert_tokens_to_ids("Ġthe")]


def byte_alphabet_char(byte: int) -> str:
    return next(c for c, b in byte_alphabet().items() if b == byte)


def test_model_is_resized_tied_and_retargeted(new, transplanted):
    model, _, new_rows = transplanted
    assert new_rows.shape == (len(new), 16) and model.config.vocab_size == len(new)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    eos = new.convert_tokens_to_ids("<|im_end|>")
    assert model.config.eos_token_id == eos and model.generation_config.eos_token_id == eos
    assert model.config.pad_token_id == eos and model.generation_config.pad_token_id == eos
    assert model.config.bos_token_id == new.convert_tokens_to_ids("<|im_start|>")
    logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, len(new))


def test_saved_directory_loads_generates_and_round_trips(tmp_path, base_dir, corpus_file):
    spec = TransplantSpec(base=ModelSpec(path=str(base_dir)), vocab_size=600, corpus=[str(corpus_file)])
    report = build_transplanted(spec, tmp_path)
    assert report.new_vocab == 600 and report.old_vocab == 420 and report.specials_matched == "3/3"
    assert 0 < report.one_old_token < 1 and report.mean_old_tokens > 1
    assert json.loads((tmp_path / "transplant.json").read_text())["new_vocab"] == 600
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.vocab_size == len(tokenizer) == 600
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Give me one tip."}], return_dict=True,
                                           return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4 or tokenizer.eos_token_id in out[0].tolist()
    for text in ROUND_TRIP:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text, text
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_model_spec_transplant_loads_through_load_model_and_is_cached(tmp_path, monkeypatch, corpus_file):
    monkeypatch.setenv("K3POST_CACHE", str(tmp_path / "cache"))
    builds = []
    real = transplant.build_transplanted
    monkeypatch.setattr(transplant, "build_transplanted", lambda *a, **k: builds.append(1) or real(*a, **k))
    base = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2), keep_layers=[1])
    spec = ModelSpec(transplant=TransplantSpec(base=base, vocab_size=500, corpus=[str(corpus_file)]))
    model, tokenizer = load_model(spec)
    assert len(tokenizer) == model.config.vocab_size == 500 and model.config.num_hidden_layers == 1
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    started = time.time()
    again, _ = load_model(spec)
    assert builds == [1] and time.time() - started < 10
    assert torch.equal(again.get_input_embeddings().weight, model.get_input_embeddings().weight)
    # the tiny tokenizer is characters only: a non-ASCII byte has no old piece, its row is the average token
    old_rows = load_model(base)[0].get_input_embeddings().weight
    row = model.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids("é")]  # the byte 0xE9
    torch.testing.assert_close(row, old_rows.mean(0))


def test_transplant_onto_another_models_tokenizer(tmp_path, monkeypatch, corpus_file):
    """`tokenizer_from`: the tokenizer of another spec (e.g. a teacher's), here a transplant of a
    transplant back onto the tiny tokenizer, whose rows are then means of the 500-token model's."""
    monkeypatch.setenv("K3POST_CACHE", str(tmp_path / "cache"))
    tiny = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2))
    away = ModelSpec(transplant=TransplantSpec(base=tiny, vocab_size=500, corpus=[str(corpus_file)]))
    back = ModelSpec(transplant=TransplantSpec(base=away, tokenizer_from=tiny))
    model, tokenizer = load_model(back)
    assert tokenizer.get_vocab() == load_model(tiny)[1].get_vocab() and model.config.vocab_size == len(tokenizer)
    middle, middle_tokenizer = load_model(away)
    a = tokenizer.convert_tokens_to_ids("a")
    torch.testing.assert_close(model.get_input_embeddings().weight[a],
                               middle.get_input_embeddings().weight[middle_tokenizer.convert_tokens_to_ids("a")])
    with pytest.raises(ValidationError, match="not both"):
        TransplantSpec(base=tiny, tokenizer="/t", tokenizer_from=tiny)


def test_spec_is_strict():
    base = {"tiny": {}}
    with pytest.raises(ValidationError, match="extra"):
        ModelSpec(transplant={"base": base, "vocab": 8000})
    with pytest.raises(ValidationError, match="exactly one of"):
        ModelSpec(tiny={}, transplant={"base": base})
    with pytest.raises(ValidationError, match="vocab_size train a tokenizer"):
        ModelSpec(transplant={"base": base, "tokenizer": "/t", "vocab_size": 8000})
    with pytest.raises(ValidationError, match="greater than 0"):
        ModelSpec(transplant={"base": base, "vocab_size": 0})
    assert ModelSpec(transplant={"base": base}).transplant.vocab_size == 12000
    assert all(f.description for f in TransplantSpec.model_fields.values())


def test_recipe_paths_of_a_transplant_are_made_absolute(tmp_path):
    spec = {"transplant": {"base": {"path": "m"}, "corpus": ["a.txt"], "tokenizer": "t"}}
    absolute_model_paths(spec, tmp_path)
    assert spec["transplant"] == {"base": {"path": str(tmp_path / "m")}, "corpus": [str(tmp_path / "a.txt")],
                                  "tokenizer": str(tmp_path / "t")}


def test_recipe_checks_see_inside_a_transplant(tmp_path):
    """`k3post validate`/`run` check a transplant's files before anything loads; submit lists them."""
    from types import SimpleNamespace

    from k3post.cli.inputs import check_models, model_specs
    from k3post.cli.submit import recipe_paths

    (tmp_path / "corpus.txt").write_text("some text")
    base = ModelSpec(path=str(tmp_path / "base"))
    student = ModelSpec(transplant=TransplantSpec(base=base, corpus=[str(tmp_path / "corpus.txt")]))
    recipe = SimpleNamespace(student=student, data=SimpleNamespace(sources=[]))
    assert model_specs(recipe)["student.transplant.base"] == base
    assert recipe_paths(recipe) == {"student.transplant.corpus[0]": str(tmp_path / "corpus.txt"),
                                    "student.transplant.base.path": str(tmp_path / "base")}
    with pytest.raises(UserError, match=r"base: model directory not found.*\n  \(named by the recipe's "
                                        r"student.transplant.base\)"):
        check_models(recipe)
    recipe.student = ModelSpec(transplant=TransplantSpec(base=ModelSpec(tiny={}), corpus=[str(tmp_path / "gone.txt")]))
    with pytest.raises(UserError, match=r"gone.txt: corpus file not found\n  \(named by the recipe's student\)"):
        check_models(recipe)


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["transplant", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_writes_a_loadable_directory_and_a_summary(tmp_path, capsys, base_dir, corpus_file):
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(capsys, out, "--base", base_dir, "--keep-layers", "1,0",
                                   "--vocab-size", 500, "--corpus", corpus_file)
    assert code == 0, stderr
    assert "training a 500-token byte-level BPE" in stderr
    assert "vocabulary 420 -> 500 tokens" in stdout and f"written to {out}" in stdout
    assert "old tokens per new token" in stdout and "are one old token" in stdout
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 2


@pytest.mark.parametrize("args, expected", [
    (["--corpus", "missing.txt"], "missing.txt: corpus file not found"),
    (["--vocab-size", "100"], "vocab_size 100 is too small"),
    (["--tokenizer", "t", "--vocab-size", "900"], "give one or the other"),
    (["--keep-layers", "0,x"], "--keep-layers '0,x'"),
    (["--keep-layers", "0,0"], "repeated layer indices"),
    (["--base", "nowhere"], "model directory not found"),
])
def test_cli_bad_input_is_one_message(tmp_path, capsys, base_dir, args, expected):
    args = [a if a != "nowhere" else str(tmp_path / "nowhere") for a in args]
    base = [] if "--base" in args else ["--base", base_dir]
    code, _, stderr = run_cli(capsys, tmp_path / "out", *base, *args)
    assert code == 2 and expected in stderr and "Traceback" not in stderr, stderr
    assert not (tmp_path / "out").exists()


def test_cli_refuses_an_untied_base_and_a_full_output(tmp_path, capsys, old, corpus_file):
    untied = tmp_path / "untied"
    tiny_llama(len(old), tied=False).save_pretrained(untied)
    old.save_pretrained(untied)
    code, _, stderr = run_cli(capsys, tmp_path / "out", "--base", untied, "--corpus", corpus_file,
                              "--vocab-size", 400)
    assert code == 2 and "not tied to its input embedding" in stderr and str(untied) in stderr, stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, _, stderr = run_cli(capsys, tmp_path / "full", "--base", untied)
    assert code == 2 and "not empty" in stderr


@pytest.mark.slow
def test_real_smollm2_pruned_student(tmp_path):
    """SmolLM2-135M-Instruct (the builtin GGUF), 24 of its 30 layers, under a 12k BPE of the
    built-in corpus: ~15 s and ~1 GB on 2 cores."""
    base = ModelSpec(builtin="smollm2-135m-instruct", keep_layers=[*range(12), *range(18, 30)])
    report = build_transplanted(TransplantSpec(base=base), tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    old_model, old = load_model(ModelSpec(builtin="smollm2-135m-instruct"))
    assert 8000 <= len(tokenizer) <= 16000 and len(tokenizer) != len(old) == 49152
    assert report.old_vocab == 49152 and report.specials_matched == "17/17"
    assert model.config.num_hidden_layers == 24 and model.config.vocab_size == len(tokenizer)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert merges != json.loads(old.backend_tokenizer.to_str())["model"]["merges"][: len(merges)]
    assert len(set(tokenizer.get_vocab()) - set(old.get_vocab())) > 500  # tokens SmolLM2 does not have
    old_rows, new_rows = old_model.get_input_embeddings().weight, model.get_input_embeddings().weight
    for token in ("Ġthe", "<|im_end|>"):
        assert torch.equal(new_rows[tokenizer.convert_tokens_to_ids(token)], old_rows[old.convert_tokens_to_ids(token)])
    for text in ROUND_TRIP:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
