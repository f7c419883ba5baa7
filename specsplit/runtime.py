"""Process-level set-up shared by the service entry points."""

from __future__ import annotations

import logging

import torch

from specsplit import default_model
from specsplit.modeling import LoadedModel, load_model
from specsplit.settings import ModelSettings


def configure_process(threads: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if threads > 0:
        torch.set_num_threads(threads)


def load(settings: ModelSettings) -> LoadedModel:
    return load_model(default_model.resolve(settings.path), settings.dtype, settings.device, settings.exact,
                      quantize=settings.quantize)
