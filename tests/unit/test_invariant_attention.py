"""The GPU attention kernel of the batch-invariant mode (model/invariant_attention.py), run on the CPU
under Triton's interpreter: it computes softmax(q·Kᵀ)·V over exactly each query's valid keys (against
the CPU reference, `batch_invariant.query_attention`), and a query's output does not depend on the
call it is in (alone as a decode step, in a whole sequence, beside a longer row, after left or right
padding). On a GPU the same properties, compiled, are tests/gpu/test_on_policy_cuda.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3post.model.batch_invariant import _valid_keys, query_attention

B, H, H_KV, D = 2, 2, 1, 16
REPO = Path(__file__).resolve().parents[2]


def test_the_kernel_under_the_interpreter():
    """The checks below in a fresh process: Triton reads TRITON_INTERPRET when it is first imported,
    which in this one has happened long before (torch imports it)."""
    pytest.importorskip("triton")
    code = ("import tests.unit.test_invariant_attention as t, k3post.model.invariant_attention as kernel; "
            "t.check_each_query_attends_to_exactly_its_valid_keys(kernel); t.check_a_query_gives_the_same_bits_in_any_call(kernel)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


def qkv(L: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g), torch.randn(B, H_KV, L, D, generator=g),
            torch.randn(B, H_KV, L, D, generator=g))


def check_each_query_attends_to_exactly_its_valid_keys(kernel):
    L = 36  # more than one block of keys (BLOCK = 32)
    q, k, v = qkv(L)
    valid = _valid_keys(None, B, L, L).clone()
    valid[1, :, :7] = False  # row 1 is left-padded: its first 7 keys are padding, its first 7 queries see nothing
    got = kernel.kernel_attention(q, k, v, valid, H // H_KV, D ** -0.5)
    want = query_attention(q, k, v, valid, H // H_KV, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1, :7], torch.zeros_like(got[1, :7]))


def check_a_query_gives_the_same_bits_in_any_call(kernel):
    """Row 0 (36 tokens, unpadded) as a whole sequence; some of its queries again as a decode step
    (one query, keys so far); and the whole row again, left-padded by 5 beside a longer row."""
    L = 36
    q, k, v = qkv(L, seed=1)
    attend = lambda q_, k_, v_, valid: kernel.kernel_attention(q_, k_, v_, valid, H // H_KV, D ** -0.5)  # noqa: E731
    whole = attend(q, k, v, _valid_keys(None, B, L, L))[0]
    for t in (0, 31, 32, 35):  # either side of a block boundary
        step = attend(q[:1, :, t:t + 1], k[:1, :, :t + 1], v[:1, :, :t + 1], _valid_keys(None, 1, 1, t + 1))
        assert torch.equal(step[0, 0], whole[t])
    pad = lambda x: torch.cat([torch.zeros(1, x.shape[1], 5, D), x[:1]], dim=2)  # noqa: E731
    longer = lambda x: x[1:2, :, :1].expand(1, x.shape[1], L + 5, D)  # noqa: E731
    q2, k2, v2 = (torch.cat([pad(x), longer(x)]) for x in (q, k, v))
    valid = _valid_keys(None, B, L + 5, L + 5).clone()
    valid[0, :, :5] = False
    assert torch.equal(attend(q2, k2, v2, valid)[0, 5:], whole)
