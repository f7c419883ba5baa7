"""Process-level set-up shared by the service entry points."""

from __future__ import annotations

import logging

import torch

from specsplit.model import catalog, weightchoice
from specsplit.model.modeling import LoadedModel, load_model
from specsplit.serving import cpus
from specsplit.serving.settings import ModelSettings
from specsplit.serving.threadtune import ThreadTuner


def configure_process(threads: int, role: str, most: int | None = None) -> str:
    """Logging, and the torch threads: `threads` if > 0, else as many as the CPUs this process may
    use (affinity, cgroup quota: specsplit.serving.cpus), at most `most`. Returns the line saying
    how many and why, for the service to log once it has started (a start that fails on bad input
    says that in one line)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    n, why = cpus.threads(threads)
    if most is not None and threads <= 0 and n > most:
        n, why = most, f"{why}; at most {most} here"
    torch.set_num_threads(n)
    return f"{role}: {n} torch thread{'s' * (n != 1)} ({why})"


def load(settings: ModelSettings, head_ids: torch.Tensor | None = None) -> LoadedModel:
    quantize = weightchoice.resolve(settings.quantize, settings.path, settings.dtype, settings.device)
    return load_model(catalog.resolve(settings.path), settings.dtype, settings.device, settings.exact,
                      quantize=quantize, head_ids=head_ids)


def tune_threads(worker, role: str, invariant: bool, fixed: bool) -> str:
    """Gives the worker a ThreadTuner when its forwards' bits do not depend on the team size
    (`invariant`: the native kernels) and the user did not fix it; returns what to add to the
    thread line."""
    from opentelemetry.metrics import Observation

    from specsplit.serving import telemetry

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
