"""The prompt mixture: weights, held-out rows, epochs, resume and seeds."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from k3post.config.errors import UserError
from k3post.data.mixture import PromptMixture, PromptSource


def _rows(prefix: str, n: int) -> list[dict]:
    return [{"id": f"{prefix}{i}", "messages": [("user", f"{prefix} question {i}?")]}
            for i in range(n)]


def _mixture(seed: int = 0, wa: float = 1.0, wb: float = 1.0, heldout: int = 4) -> PromptMixture:
    return PromptMixture([
        PromptSource("a", _rows("a", 40), teacher="ta", weight=wa, heldout=heldout),
        PromptSource("b", _rows("b", 30), teacher="tb", weight=wb, heldout=heldout),
    ], seed=seed)


def _uids(batch) -> list[str]:
    return [p.uid for p in batch]


@pytest.mark.parametrize("wa, wb, expected", [(1.0, 1.0, {"a": 4, "b": 4}), (3.0, 1.0, {"a": 6, "b": 2})])
def test_counts_follow_weights(wa, wb, expected):
    m = _mixture(wa=wa, wb=wb)
    for _ in range(10):
        assert Counter(p.source for p in m.next_batch(8)) == expected


def test_small_batches_follow_weights_over_time():
    # Three equal sources and 8 prompts a batch: no source may be short every time.
    m = PromptMixture([PromptSource(s, _rows(s, 20), teacher="t", heldout=2) for s in "xyz"], seed=0)
    totals = Counter(p.source for _ in range(30) for p in m.next_batch(8))
    assert totals == {"x": 80, "y": 80, "z": 80}


def test_prompt_fields():
    m = _mixture()
    p = m.next_batch(2)[0]
    assert p.source == "a" and p.teacher == "ta" and p.uid.startswith("a/a")
    assert isinstance(p.messages, tuple) and all(isinstance(t, tuple) for t in p.messages)
    assert p.messages == (("user", f"a question {p.uid.split('/a')[1]}?"),)
    assert m.teachers() == ["ta", "tb"]


def test_heldout_never_trained_on():
    m = _mixture(heldout=4)
    held = {p.uid for p in m.heldout()}
    assert len(held) == 8 and len(m.heldout("a")) == 4 and len(m.heldout("b")) == 4
    assert held == {p.uid for p in _mixture(seed=123).heldout()}  # independent of the seed
    trained = {uid for _ in range(50) for uid in _uids(m.next_batch(8))}
    assert not trained & held
    assert len(trained) == 70 - 8  # everything else was trained on
    with pytest.raises(UserError, match="unknown prompt source 'c'"):
        m.heldout("c")


def test_each_epoch_covers_every_training_row_once():
    m = PromptMixture([PromptSource("a", _rows("a", 40), teacher="t", heldout=4)], seed=7)
    epochs = [_uids(m.next_batch(36)) for _ in range(3)]
    train = {f"a/a{i}" for i in range(40)} - {p.uid for p in m.heldout()}
    for epoch in epochs:
        assert len(epoch) == 36 and set(epoch) == train
    assert epochs[0] != epochs[1]  # reshuffled each epoch


def test_batches_spanning_epochs_still_cover_each_epoch():
    m = PromptMixture([PromptSource("a", _rows("a", 10), teacher="t", heldout=1)], seed=1)
    stream = [uid for _ in range(9) for uid in _uids(m.next_batch(5))]  # 45 = 5 epochs of 9
    for e in range(5):
        assert len(set(stream[9 * e: 9 * e + 9])) == 9


def test_a_peeked_batch_is_the_next_batch_and_draws_nothing():
    m, twin = _mixture(seed=3, wa=2.0, wb=1.0), _mixture(seed=3, wa=2.0, wb=1.0)
    for _ in range(9):  # across epoch ends of both sources
        peeked = m.peek_batch(10)
        assert m.peek_batch(10) == peeked == m.next_batch(10) == twin.next_batch(10)
    assert m.state_dict() == twin.state_dict()


def test_resume_from_json_state_gives_identical_batches():
    original = _mixture(seed=3, wa=2.0, wb=1.0)
    for _ in range(7):  # past the end of an epoch of b (26 training rows)
        original.next_batch(10)
    state = json.loads(json.dumps(original.state_dict()))
    resumed = _mixture(seed=3, wa=2.0, wb=1.0)
    resumed.load_state_dict(state)
    for _ in range(10):
        assert original.next_batch(10) == resumed.next_batch(10)


def test_resume_refuses_other_seed_or_rows():
    state = _mixture(seed=3).state_dict()
    with pytest.raises(UserError, match="seed"):
        _mixture(seed=4).load_state_dict(state)
    with pytest.raises(UserError, match="training rows of source 'a' changed"):
        _mixture(seed=3, heldout=5).load_state_dict(state)


def test_resume_refuses_the_same_ids_with_other_prompts_and_takes_a_state_saved_before_the_check():
    """A file edited in place keeps its position ids ("a-0", ...): the text tells them apart."""
    state = _mixture(seed=3).state_dict()
    def edited_rows(prefix: str, n: int) -> list[dict]:
        return [{**row, "messages": [("user", row["messages"][0][1] + " (edited)")]} for row in _rows(prefix, n)]

    edited = PromptMixture([PromptSource("a", edited_rows("a", 40), teacher="ta", heldout=4),
                            PromptSource("b", _rows("b", 30), teacher="tb", heldout=4)], seed=3)
    with pytest.raises(UserError, match="training prompts of source 'a' changed .* other text"):
        edited.load_state_dict(state)
    for source in state["sources"]:
        del source["content"]  # as an earlier k3post saved it
    edited.load_state_dict(state)


def test_seeds_change_order_and_same_seed_repeats():
    def first_batches(seed):
        m = _mixture(seed=seed)
        return [_uids(m.next_batch(8)) for _ in range(3)]

    assert first_batches(0) == first_batches(0)
    assert first_batches(0) != first_batches(1)


@pytest.mark.parametrize(
    "sources, message",
    [
        ([PromptSource("a", _rows("a", 5), "t", weight=0.0)], "'a': weight must be a number > 0"),
        ([PromptSource("a", _rows("a", 5), "t", weight=-1)], "'a': weight must be a number > 0"),
        ([PromptSource("a", _rows("a", 5), "t", heldout=5)], "'a': heldout=5 leaves no training"),
        ([PromptSource("a", _rows("a", 5), "t", heldout=1)] * 2, "'a' is listed twice"),
        ([], "at least one source"),
    ],
)
def test_validation(sources, message):
    with pytest.raises(UserError, match=message):
        PromptMixture(sources, seed=0)
