"""Conversions between the wire's common messages and the maths' plain values: target features
(a [rows, dim] tensor <-> specsplit.common.v1.Features), sampling settings, log-probabilities and
proposal distributions. torch is imported by the conversions that make tensors: the gateway uses
the others, relays features as bytes and never loads torch (a second less to start, 200 MB less)."""

from __future__ import annotations

import math
from functools import cache
from typing import TYPE_CHECKING

from specsplit.api.common.v1 import common_pb2 as pb
from specsplit.speculation.params import Logprobs, Method, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import torch

DTYPES = ("bfloat16", "float16", "float32")  # what features may travel as


@cache
def _carriers() -> dict:
    """dtype name -> (its torch dtype, the integer type of its width that carries its bytes)."""
    import torch

    return {"bfloat16": (torch.bfloat16, torch.int16), "float16": (torch.float16, torch.int16),
            "float32": (torch.float32, torch.int32)}


def encode(features: torch.Tensor, start: int) -> pb.Features:
    """Rows keep the target's dtype (bfloat16: 2 bytes a value)."""
    name = str(features.dtype).removeprefix("torch.")
    if name not in DTYPES:
        features, name = features.float(), "float32"
    raw = features.detach().contiguous().cpu().view(_carriers()[name][1]).numpy().tobytes()
    return pb.Features(start=start, rows=features.shape[0], dim=features.shape[1], dtype=name, data=raw)


def decode(message: pb.Features) -> torch.Tensor:
    """A float32 [rows, dim] tensor; ValueError when the message is inconsistent."""
    import torch

    if message.dtype not in DTYPES:
        raise ValueError(f"features dtype {message.dtype!r} is not one of {sorted(DTYPES)}")
    dtype, carrier = _carriers()[message.dtype]
    expected = message.rows * message.dim * torch.tensor([], dtype=dtype).element_size()
    if len(message.data) != expected:
        raise ValueError(f"features: {len(message.data)} bytes for {message.rows} x {message.dim} {message.dtype}")
    if not message.rows:
        return torch.zeros(0, message.dim, dtype=torch.float32)
    flat = torch.frombuffer(bytearray(message.data), dtype=carrier).view(dtype)
    return flat.reshape(message.rows, message.dim).float()


METHODS = {pb.VERIFY_METHOD_UNSPECIFIED: Method.COUPLED, pb.VERIFY_METHOD_COUPLED: Method.COUPLED,
           pb.VERIFY_METHOD_REJECTION: Method.REJECTION}


def sampling(message, seed: int | None = None) -> SamplingParams:
    """A Sampling message (or the gateway's public SamplingParams, whose fields have the same names)
    as the one sampling type, checked: ValueError says what is wrong. `seed` replaces the message's."""
    if message.method not in METHODS:
        raise ValueError(f"unknown verify method {message.method}")
    params = SamplingParams(temperature=message.temperature, top_k=message.top_k, top_p=message.top_p or 1.0,
                            seed=message.seed if seed is None else seed, method=METHODS[message.method])
    params.check()
    return params


def sampling_message(params: SamplingParams) -> pb.Sampling:
    method = pb.VERIFY_METHOD_REJECTION if params.method is Method.REJECTION else pb.VERIFY_METHOD_COUPLED
    return pb.Sampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
                       method=method)


def logprobs(message: pb.LogprobsRequest) -> Logprobs:
    return Logprobs(generated=message.generated, top=message.top, prompt=message.prompt)


def token_logprobs(values: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    """(token, logprob, top ids, top logprobs) tuples -> messages."""
    return [pb.TokenLogprob(token_id=t, logprob=lp, top_ids=ids, top_logprobs=top) for t, lp, ids, top in values]


def sparse(message: pb.SparseProbs) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, probs); ValueError unless it is a probability distribution."""
    if len(message.token_ids) != len(message.probs) or not message.token_ids:
        raise ValueError(f"a proposal has {len(message.token_ids)} ids and {len(message.probs)} probabilities")
    if len(set(message.token_ids)) != len(message.token_ids):
        raise ValueError("a proposal lists a token id more than once")
    probs = list(message.probs)
    if any(not math.isfinite(x) or x < 0 for x in probs) or abs(sum(probs) - 1) > 1e-3:
        raise ValueError(f"a proposal's probabilities must be finite, >= 0 and sum to 1 (sum {sum(probs):.4f})")
    import torch

    return torch.tensor(list(message.token_ids), dtype=torch.long), torch.tensor(probs, dtype=torch.float32)
