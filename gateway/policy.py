"""The calibrated policy (`specsplit calibrate`): per task type and drafter, speculate or not and
with which gamma, for one pair of models. The gateway starts its controller from it when the models
are the ones it was measured with; otherwise it warns and adapts live (models changed: recalibrate)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from gateway.controller import Controller
from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.verify.v1 import verify_pb2 as vpb

log = logging.getLogger("specsplit.gateway")
VERSION = 1


def drafter_identity(d: dpb.DrafterInfo) -> dict:
    return {"kind": d.kind, "model_id": d.model_id, "tokenizer_fingerprint": d.tokenizer_fingerprint,
            "target_model_fingerprint": d.target_model_fingerprint, "param_bytes": d.param_bytes}


def write(path: str | Path, target: vpb.InfoResponse, drafters: dict[str, dpb.DrafterInfo],
          task_types: dict[str, dict[str, dict]]) -> None:
    """task_types: task type -> drafter name -> {"speculate", "gamma", and the measured figures}."""
    used = {name for per in task_types.values() for name in per}
    document = {"version": VERSION,
                "target": {"model_id": target.model_id, "model_fingerprint": target.model_fingerprint},
                "drafters": {name: drafter_identity(drafters[name]) for name in sorted(used)},
                "task_types": task_types}
    Path(path).write_text(json.dumps(document, indent=1) + "\n")


def apply(path: str | Path, controller: Controller, target: vpb.InfoResponse,
          drafters: dict[str, dpb.DrafterInfo]) -> list[str]:
    """Seeds the controller from the policy; returns warnings (empty when all of it applied)."""
    document = json.loads(Path(path).read_text())
    if document.get("version") != VERSION:
        return [f"policy {path}: version {document.get('version')} is not {VERSION}; adapting live"]
    theirs = document["target"]["model_fingerprint"]
    if theirs != target.model_fingerprint:
        return [f"policy {path} was calibrated for target weights {theirs}, the target has "
                f"{target.model_fingerprint}: ignoring it and adapting live (recalibrate with `specsplit calibrate`)"]
    warnings, stale = [], set()
    for name, identity in document["drafters"].items():
        info = drafters.get(name)
        if info is None or drafter_identity(info) != identity:
            stale.add(name)
            warnings.append(f"policy {path}: drafter {name!r} is not the one it was calibrated with; adapting it "
                            "live (recalibrate with `specsplit calibrate`)")
    for task, per in document["task_types"].items():
        for name, entry in per.items():
            if name not in stale:
                controller.seed_policy(task, name, bool(entry["speculate"]), int(entry["gamma"]))
    return warnings
