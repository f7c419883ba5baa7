"""Conversions between the wire's common messages and the maths' plain values: target features
(a [rows, dim] tensor <-> specsplit.common.v1.Features), sampling settings and log-probabilities."""

from __future__ import annotations

import torch

from specsplit.api.common.v1 import common_pb2 as pb
from specsplit.spec.sampling import Logprobs, SamplingParams, TokenLogprob

_WIRE = {"bfloat16": (torch.bfloat16, torch.int16), "float16": (torch.float16, torch.int16),
         "float32": (torch.float32, torch.int32)}


def encode(features: torch.Tensor, start: int) -> pb.Features:
    """Rows keep the target's dtype (bfloat16: 2 bytes a value)."""
    name = str(features.dtype).removeprefix("torch.")
    if name not in _WIRE:
        features, name = features.float(), "float32"
    raw = features.detach().contiguous().cpu().view(_WIRE[name][1]).numpy().tobytes()
    return pb.Features(start=start, rows=features.shape[0], dim=features.shape[1], dtype=name, data=raw)


def decode(message: pb.Features) -> torch.Tensor:
    """A float32 [rows, dim] tensor; ValueError when the message is inconsistent."""
    if message.dtype not in _WIRE:
        raise ValueError(f"features dtype {message.dtype!r} is not one of {sorted(_WIRE)}")
    dtype, carrier = _WIRE[message.dtype]
    expected = message.rows * message.dim * torch.tensor([], dtype=dtype).element_size()
    if len(message.data) != expected:
        raise ValueError(f"features: {len(message.data)} bytes for {message.rows} x {message.dim} {message.dtype}")
    if not message.rows:
        return torch.zeros(0, message.dim, dtype=torch.float32)
    flat = torch.frombuffer(bytearray(message.data), dtype=carrier).view(dtype)
    return flat.reshape(message.rows, message.dim).float()


def sampling(message: pb.Sampling) -> tuple[SamplingParams, str]:
    """A Sampling message -> (params, "coupled" | "rejection")."""
    method = "rejection" if message.method == pb.VERIFY_METHOD_REJECTION else "coupled"
    return SamplingParams(temperature=message.temperature, top_k=message.top_k, top_p=message.top_p or 1.0,
                          seed=message.seed), method


def logprobs(message: pb.LogprobsRequest) -> Logprobs:
    return Logprobs(generated=message.generated, top=message.top, prompt=message.prompt)


def token_logprobs(values: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    """(token, logprob, top ids, top logprobs) tuples -> messages."""
    return [pb.TokenLogprob(token_id=t, logprob=lp, top_ids=ids, top_logprobs=top) for t, lp, ids, top in values]
