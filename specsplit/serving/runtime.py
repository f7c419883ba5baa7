"""Process-level set-up shared by the service entry points."""

from __future__ import annotations

import logging

import torch

from specsplit.model import catalog
from specsplit.model.modeling import LoadedModel, load_model
from specsplit.serving.settings import ModelSettings


def configure_process(threads: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if threads > 0:
        torch.set_num_threads(threads)


def load(settings: ModelSettings, head_ids: torch.Tensor | None = None) -> LoadedModel:
    return load_model(catalog.resolve(settings.path), settings.dtype, settings.device, settings.exact,
                      quantize=settings.quantize, head_ids=head_ids)
