"""Speculative sampling through the real services is lossless: continuations sampled with
speculation (rejection and coupled verification, a model drafter whose q differs from p) follow the
target's own distribution, computed exactly from the model; a deliberately broken residual does not."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import torch
from conftest import running_stack

from specsplit.common.v1 import common_pb2 as cpb
from specsplit.gateway.v1 import gateway_pb2 as pb
from specsplit.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.sampling import RESAMPLE, SamplingParams, sample, uniform, warp
from verify_service import engine

PROMPT = "Once upon a time"
NEW = 4  # the first token comes from prefill; the next three from one or two draft/verify rounds
TEMPERATURE, TOP_K = 1.5, 2
SAMPLES = 800  # sampling noise alone gives a total variation of ~0.055 over 16 outcomes


def exact_distribution(model_dir, prompt_ids: list[int]) -> dict[tuple[int, ...], float]:
    """P(tokens 2..NEW) under the target, summed over token 1: the outcome of the speculative rounds."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(TEMPERATURE, TOP_K)

    @torch.inference_mode()
    def dist(ids: list[int]) -> dict[int, float]:
        probs = warp(model(torch.tensor([ids])).logits[0, -1:], params)[0]
        return {int(t): float(probs[t]) for t in probs.nonzero()[:, 0]}

    out: Counter = Counter()

    def walk(ids: list[int], prob: float, tail: tuple[int, ...]) -> None:
        if len(ids) == len(prompt_ids) + NEW:
            out[tail] += prob
            return
        for token, p in dist(ids).items():
            walk(ids + [token], prob * p, tail + (token,) if len(ids) > len(prompt_ids) else tail)

    walk(prompt_ids, 1.0, ())
    return dict(out)


def total_variation(counts: Counter, exact: dict) -> float:
    n = sum(counts.values())
    return sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(counts) | set(exact)) / 2


def broken_rejection_accept(probs, draft, proposals, seed, start):
    """Rejection sampling with the classic mistake: resampling from p instead of norm(max(0, p - q))."""
    for i, token in enumerate(draft):
        ids, q = proposals[i]
        q_tok = float(q[ids == token].sum())
        if uniform(seed, start + i, 1) >= min(1.0, float(probs[i, token]) / q_tok):
            return i, sample(probs[i], seed, start + i, RESAMPLE), "recovered"
    return len(draft), sample(probs[len(draft)], seed, start + len(draft), RESAMPLE), "bonus"


async def continuations(gw, method: int, speculation: int) -> tuple[Counter, int]:
    counts: Counter = Counter()
    drafted = 0

    async def one(seed: int) -> None:
        nonlocal drafted
        response = await gw.Generate(pb.GenerateRequest(
            text=PROMPT, max_new_tokens=NEW, stop=pb.StopConditions(ignore_eos=True), speculation=speculation,
            drafter="model", gamma=3,
            sampling=pb.SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=seed, method=method)))
        assert len(response.token_ids) == NEW
        counts[tuple(response.token_ids[1:])] += 1
        drafted += response.stats.drafted_tokens

    for first in range(0, SAMPLES, 32):
        await asyncio.gather(*(one(seed) for seed in range(first, min(first + 32, SAMPLES))))
    return counts, drafted


async def test_sampled_continuations_follow_the_target_and_a_broken_residual_does_not(models, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(models["target"]).encode(PROMPT)
    exact = exact_distribution(models["target"], prompt_ids)
    assert len(exact) > 4 and max(exact.values()) < 0.6  # a spread the test can see
    tv = {}
    async with running_stack(tmp_path, "unix", models["target"], models["draft"], "float32") as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            for name, method, speculation in (("off", cpb.VERIFY_METHOD_COUPLED, pb.SPECULATION_OFF),
                                              ("rejection", cpb.VERIFY_METHOD_REJECTION, pb.SPECULATION_ON),
                                              ("coupled", cpb.VERIFY_METHOD_COUPLED, pb.SPECULATION_ON)):
                counts, drafted = await continuations(gw, method, speculation)
                tv[name] = total_variation(counts, exact)
                assert drafted >= (SAMPLES if speculation == pb.SPECULATION_ON else 0)
            monkeypatch.setattr(engine, "rejection_accept", broken_rejection_accept)
            counts, _ = await continuations(gw, cpb.VERIFY_METHOD_REJECTION, pb.SPECULATION_ON)
            tv["broken"] = total_variation(counts, exact)
    print(f"total variation from the exact distribution over {len(exact)} outcomes: {tv}")
    for name in ("off", "rejection", "coupled"):
        assert tv[name] < 0.1, tv  # 1200 samples measured: off 0.044, rejection 0.050
    assert tv["broken"] > 0.2, tv  # 1200 samples measured: 0.31

