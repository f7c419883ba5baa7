"""`specsplit calibrate`: per task type, speculation on vs off through the real services; prints
acceptance length, draft cost ratio, the seed's estimate next to the measured speedup and the
controller's cost model, recommends on/off and gamma, and writes a policy file for the gateway."""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import grpc

from gateway import policy
from gateway.controller import Controller, Decision
from gateway.instruments import outcome
from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.draft.v1 import draft_pb2_grpc as dpb_grpc
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc
from specsplit.bench.workload import Prompt, load_prompts, request, warmup
from specsplit.launcher import StackConfig, gateway_stub
from specsplit.serving.settings import ControllerSettings

FORCED = Decision(True, 0, "forced")  # observed for statistics only: calibration decides itself


def measure(stub, prompts: list[Prompt], drafter: str, gamma: int, max_new_tokens: int, repeats: int,
            controller: Controller) -> dict[str, dict[str, float]]:
    """Runs every prompt off and on; feeds the controller's statistics; returns wall times per type."""
    walls: dict[str, dict[str, float]] = defaultdict(lambda: {"off_s": 0.0, "on_s": 0.0, "off_tokens": 0,
                                                              "on_tokens": 0})
    for i, p in enumerate(prompts, 1):
        for _ in range(repeats):
            for mode in (pb.SPECULATION_OFF, pb.SPECULATION_ON):
                req = request(p, mode, max_new_tokens)
                req.drafter, req.gamma = drafter, gamma
                start = time.perf_counter()
                out = stub.Generate(req, timeout=600)
                key = "on" if mode == pb.SPECULATION_ON else "off"
                walls[p.task_type][f"{key}_s"] += time.perf_counter() - start
                walls[p.task_type][f"{key}_tokens"] += len(out.token_ids)
                controller.observe(p.task_type, drafter, FORCED, outcome(out.stats))
        print(f"[{i}/{len(prompts)}] {p.task_type}", file=sys.stderr, flush=True)
    return walls


def recommend(controller: Controller, walls: dict, drafter: str, gamma: int) -> dict[str, dict]:
    out = {}
    for task, w in walls.items():
        st = controller.state(task, drafter)
        speedup = (w["on_tokens"] / w["on_s"]) / (w["off_tokens"] / w["off_s"])
        acc = st.tokens_per_round.value or 1.0
        target_step = st.off_time_per_token() or 0.0
        cost = (st.draft_ms_per_token.value or 0.0) / target_step if target_step else 0.0
        best = st.best_gamma()
        on_best, off = st.time_per_token(best), st.off_time_per_token()
        out[task] = {
            "speculate": speedup > 1.02, "gamma": best, "measured_speedup": round(speedup, 3),
            "acceptance_length": round(acc, 3), "alpha": round(st.alpha or 0.0, 3),
            "draft_cost_ratio": round(cost, 4),
            "seed_estimate": round(1 / (gamma / acc + cost), 3),
            "model_speedup_at_gamma": round(off / on_best, 3) if on_best and off else None,
            "calibrated_gamma": gamma,
        }
    return out


def main(args, config: StackConfig) -> int:
    prompts = load_prompts(args.prompts, args.limit)
    controller = Controller(ControllerSettings(gamma_start=args.gamma))
    with gateway_stub(args.gateway, config, args.auth_token_file) as (stub, stack):
        first = stub.Generate(request(warmup(prompts), pb.SPECULATION_ON, 16), timeout=600).stats
        drafter, tree = first.drafter, first.tree_budget
        walls = measure(stub, prompts, drafter, args.gamma, args.max_new_tokens, args.repeats, controller)
        target, drafters = describe(stack.addresses if stack else None, args)
    table = recommend(controller, walls, drafter, args.gamma)
    for entry in table.values():
        entry["tree_budget"] = tree  # measured with token trees of this size (0: chains)
    print(f"specsplit calibrate: {len(prompts)} prompts, drafter {drafter}, gamma {args.gamma} "
          f"({f'token trees of up to {tree} drafts, gamma deep' if tree else 'chains'}), "
          f"max_new_tokens {args.max_new_tokens}, repeats {args.repeats}")
    print(f"{'task type':<12}{'acc.len':>8}{'alpha':>7}{'cost':>7}{'seed est.':>10}{'measured':>9}"
          f"{'model@best':>11}{'gamma':>6}  recommendation")
    for task, r in sorted(table.items()):
        model = f"{r['model_speedup_at_gamma']:.2f}x" if r["model_speedup_at_gamma"] else "-"
        print(f"{task:<12}{r['acceptance_length']:>8.2f}{r['alpha']:>7.2f}{r['draft_cost_ratio']:>7.3f}"
              f"{r['seed_estimate']:>9.2f}x{r['measured_speedup']:>8.2f}x{model:>11}{r['gamma']:>6}  "
              f"{'speculate' if r['speculate'] else 'do not speculate'}")
    print("seed est. = 1 / (gamma / acc.len + draft cost ratio), the seed's estimate; measured = tok/s on / off; "
          "model@best = the controller's cost model at the recommended gamma")
    if args.policy_out and target is not None:
        policy.write(args.policy_out, target, drafters, {task: {drafter: r} for task, r in table.items()})
        print(f"policy written to {args.policy_out} (gateway: --policy {args.policy_out})")
    return 0


def describe(addresses: dict | None, args):
    """The target's and drafters' identities for the policy file."""
    verify = addresses["verify"] if addresses else args.verify
    draft = addresses["draft"] if addresses else args.draft
    if not verify or not draft:
        print("no --verify/--draft address: the policy file cannot record the models; not writing it",
              file=sys.stderr)
        return None, {}
    with grpc.insecure_channel(verify) as v, grpc.insecure_channel(draft) as d:
        target = vpb_grpc.VerifierStub(v).Info(vpb.InfoRequest(), timeout=30)
        drafters = {x.name: x for x in dpb_grpc.DrafterStub(d).Info(dpb.InfoRequest(), timeout=30).drafters}
    return target, drafters
