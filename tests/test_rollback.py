"""specsplit.speculation.rollback's contract, held against every cache that meets it: the target's KV cache and
the model drafter's (the same Sequence, native and transformers), and the self-draft head's
one-layer caches (torch and native)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_head

from specsplit.model import native
from specsplit.model.headserving import NativeHead, TorchHead
from specsplit.model.modeling import KVSequence, load_model


def _sequences(models, native_kernels: bool):
    why = native.unavailable(torch.float32, torch.device("cpu"))
    if native_kernels and why:
        pytest.skip(f"native kernels: {why}")
    lm = load_model(models["target"], "float32", native=native_kernels)
    tokens = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    return (lambda: KVSequence(lm)), (lambda cache, i, j: cache.forward(tokens[i:j]))


def _head_caches(runner_type):
    head = random_head(0, head_dim=16)
    runner = runner_type(head) if runner_type is TorchHead else runner_type(head, 64)
    feats, tokens = torch.randn(12, 32), torch.randint(0, 50, (12,)).tolist()
    return runner.new_cache, (lambda cache, i, j: runner.step(cache, feats[i:j], tokens[i:j])[1])


CACHES = {
    "target/model drafter, native": lambda models: _sequences(models, True),
    "target/model drafter, transformers": lambda models: _sequences(models, False),
    "self head, torch": lambda models: _head_caches(TorchHead),
    "self head, native": lambda models: _head_caches(NativeHead),
}


@pytest.mark.parametrize("kind", CACHES)
def test_truncate_rolls_back_by_position(models, kind, kernel_path):
    new, feed = CACHES[kind](models)
    cache = new()
    feed(cache, 0, 6)
    feed(cache, 6, 9)  # positions 6..8: a rejected block
    assert cache.length == 9
    for bad in (10, -1):  # past the end or negative: refused, nothing changes
        with pytest.raises(ValueError):
            cache.truncate(bad)
        assert cache.length == 9
    cache.truncate(9)  # a no-op
    cache.truncate(6)
    assert cache.length == 6
    again = feed(cache, 9, 12)  # written from position 6, as if 6..8 had never been fed
    fresh = new()
    feed(fresh, 0, 6)
    expected = feed(fresh, 9, 12)
    assert cache.length == fresh.length == 9
    if "native" in kind:  # the native kernels are exact by construction: bit for bit
        assert torch.equal(again, expected)
    else:
        torch.testing.assert_close(again.float(), expected.float(), rtol=1e-5, atol=1e-5)
    cache.truncate(0)
    assert cache.length == 0
