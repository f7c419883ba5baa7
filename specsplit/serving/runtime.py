"""Process-level set-up shared by the service entry points. torch and the model code are imported
where a function needs them: the gateway uses this module and never loads torch."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from specsplit.serving import cpus
from specsplit.serving.settings import ModelSettings

if TYPE_CHECKING:
    import torch

    from specsplit.model.modeling import LoadedModel


def configure_process(threads: int, role: str, compute: bool = True) -> str:
    """Logging, and for a process that computes (`compute`) the torch threads: `threads` if > 0,
    else as many as the CPUs this process may use (affinity, cgroup quota:
    specsplit.serving.cpus). Returns the line saying how many and why, for the service to log once
    it has started (a start that fails on bad input says that in one line)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not compute:
        return f"{role}: no model compute here (torch not loaded)"
    import torch

    n, why = cpus.threads(threads)
    torch.set_num_threads(n)
    return f"{role}: {n} torch thread{'s' * (n != 1)} ({why})"


def load(settings: ModelSettings, head_ids: torch.Tensor | None = None) -> LoadedModel:
    from specsplit.model import catalog, weightchoice
    from specsplit.model.modeling import load_model

    quantize = weightchoice.resolve(settings.quantize, settings.path, settings.dtype, settings.device)
    return load_model(catalog.resolve(settings.path), settings.dtype, settings.device, settings.exact,
                      quantize=quantize, head_ids=head_ids)


def tune_threads(worker, role: str, invariant: bool, fixed: bool) -> str:
    """Gives the worker a ThreadTuner when its forwards' bits do not depend on the team size
    (`invariant`: the native kernels) and the user did not fix it; returns what to add to the
    thread line."""
    import torch
    from opentelemetry.metrics import Observation

    from specsplit.serving import telemetry
    from specsplit.serving.threadtune import ThreadTuner

    most = torch.get_num_threads()
    telemetry.meter().create_observable_gauge(
        f"specsplit.{role}.threads", unit="{thread}", description="the team size of the model's forwards now",
        callbacks=[lambda _: [Observation(worker.tuner.current if worker.tuner else most)]])
    if most == 1:
        return ""
    if fixed or not invariant:
        why = "--fixed-threads" if fixed else "transformers' forward"
        return f"; each forward on {most} ({why})"
    from specsplit.serving.cpus import idle_clock

    worker.tuner = ThreadTuner(most, torch.set_num_threads, name=role, idle=idle_clock())
    return "; fewer per forward while the scheduler does not run them all (see --fixed-threads)"
