"""The dispatch section (``cgrt bench --sections dispatch``, issue 38), for the toy (section
7) and the transformers models: the same requests served three ways, side by side, in one
run, each after an untimed run of its own:

* ``device``: the device loop (``cudagraph_rt.dispatch.DeviceLoop``), its rounds one launch
  of conditional graph nodes per ``--launch-rounds`` (64) rounds where CUDA allows;
* ``host rounds``: the same loop, its rounds driven by the host one by one (the fallback);
* ``host runner``: today's ``SpecRunner``, which plans every step on the host.

k=4, the coin drafter at p=0.7 (a test double: the device loop's ``CoinRounds`` /
``PlanRounds``, the runner's ``ToyDrafter`` / ``ReferenceDrafter``: on the toy the very same
drafts; on a transformers model the same rate by another coin, so the acceptance is
printed beside each figure). Greedy, so every variant's tokens must be equal. Served one
sequence at a time and at several at once. On a CPU every variant runs (the loop emulated)
and no goal is judged.
"""
from __future__ import annotations

from types import SimpleNamespace

K, ACCEPT_PROB = 4, 0.7
TOY_GOAL, HF_GOAL, BUSY_GOAL, LAUNCH_GOAL = 1.5, 1.2, 0.97, 2.0


def _args(seed: int, slots: int) -> SimpleNamespace:
    return SimpleNamespace(k=K, accept_prob=ACCEPT_PROB, seed=seed, slots=slots, lanes=1, chunk=128, rounds=0,
                           drafter="coin", launch_rounds=64, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                           profile=None)


def _brief(r: dict) -> dict:
    keep = ("tokens", "seconds", "tokens_per_s", "steps", "gpu_busy", "mean_accepted", "accepted", "proposed", "loop")
    return {**{k: r.get(k) for k in keep}, "check_ok": r["check"]["ok"]}


def run_section(model, *, graphs: bool, seed: int, sequences: tuple[int, ...], requests: int, new: int,
                near_ties: bool = False) -> dict:
    """Each of ``sequences`` (served at once) over ``requests`` random requests of up to
    ``new`` tokens: the three variants' figures, ratios and whether their tokens agree.
    ``near_ties``: the model's greedy tokens may round another way in another width (a bf16
    transformers model; not the toy, whose logits' margins are wide), so the runner's tokens
    may differ from the loop's where its tie-aware check passes; elsewhere they must be equal."""
    from ..demo import serve, serve_loop

    loop_graphs = True if graphs else "emulate"
    rows = []
    for S in sequences:
        reqs = serve.make_requests(model.config, max(requests, S), new, seed)
        args = _args(seed, S)
        device = serve_loop.serve_loop(model, reqs, loop_graphs, args)
        rounds = serve_loop.serve_loop(model, reqs, loop_graphs, args, conditional=False)
        # the runner's coin follows the loop's served tokens where it needs a plan (the
        # transformers models; the toy's coin knows its rule)
        runner = serve.serve(model, reqs, graphs, args, plans=device["finished_seqs"])
        tokens = [device["generated"], rounds["generated"], runner["generated"]]
        best_host = max(rounds["tokens_per_s"], runner["tokens_per_s"])
        rows.append({
            "sequences": S, "requests": len(reqs), "device": _brief(device), "host_rounds": _brief(rounds),
            "host_runner": _brief(runner), "rounds_ran": device["loop"]["rounds_ran"],
            "device_over_host_rounds": device["tokens_per_s"] / rounds["tokens_per_s"],
            "device_over_host_runner": device["tokens_per_s"] / runner["tokens_per_s"],
            "device_over_best_host": device["tokens_per_s"] / best_host,
            # the loop and its host-driven twin: equal bit for bit; the runner batches rows into
            # other widths, so a bf16 transformers model may round a near-tie another way (its
            # check, tie-aware, says whether that is all it is)
            "tokens_equal": tokens[0] == tokens[1] and (tokens[0] == tokens[2] or near_ties),
            "runner_tokens_equal": tokens[0] == tokens[2],
            "runner_replans": runner.get("replans", 0),
            "checks_ok": all(r["check"]["ok"] for r in (device, rounds, runner)),
        })
    return {"status": "ok", "k": K, "accept_prob": ACCEPT_PROB, "drafter": "coin (a test double, p=0.7)",
            "rows": rows}


def goal_values(sec: dict, toy: bool) -> list[tuple[str, float | None, str, bool | None]]:
    """``(goal, value, target, met)`` of the issue's goals at one sequence (value None:
    not measured, e.g. the loop ran host-driven where CUDA lacks conditional nodes)."""
    one = next((r for r in sec.get("rows", []) if r["sequences"] == 1), None)
    if one is None:
        return []
    d = one["device"]
    conditional = one["rounds_ran"] == "conditional"
    goal = TOY_GOAL if toy else HF_GOAL
    v = one["device_over_best_host"] if conditional else None
    busy = d["gpu_busy"] if conditional else None
    per = d["loop"]["launches_per_64_tokens"] if conditional else None
    return [
        ("device dispatch / the faster host-driven loop, 1 seq, k=4", v, f">= {goal}x", v is not None and v >= goal),
        ("device dispatch: GPU busy, 1 seq", busy, f">= {BUSY_GOAL:.0%}", busy is not None and busy >= BUSY_GOAL),
        ("device dispatch: host launches per 64 tokens, 1 seq", per, f"<= {LAUNCH_GOAL:g}",
         per is not None and per <= LAUNCH_GOAL),
        ("device dispatch: tokens equal the host-driven loop's (every row)",
         float(all(r["tokens_equal"] for r in sec["rows"])), "1 (equal)", all(r["tokens_equal"] for r in sec["rows"])),
    ]


def table(sec: dict):
    """The section's table (rich)."""
    from rich.table import Table

    from ..console import fit

    t = Table(title=f"dispatch: k={sec['k']}, drafter {sec['drafter']}; tokens/s (mean accepted of k)",
              caption="device: the rounds in one launch per 64 (conditional nodes) or, where CUDA lacks them, "
                      "host-driven (rounds ran); host rounds: the same loop driven round by round; host runner: "
                      "SpecRunner; equal: the loop's tokens, its host-driven twin's and SpecRunner's (runner: "
                      "near ties: SpecRunner's differ where a bf16 near-tie rounded another way, its tie-aware "
                      "check passing)",
              caption_justify="left")
    for h in ("seqs", "device", "host rounds", "host runner", "x rounds", "x runner", "busy", "launches/64",
              "rounds ran", "equal"):
        t.add_column(h, justify="right")
    for r in sec["rows"]:
        d, h, s = r["device"], r["host_rounds"], r["host_runner"]
        cell = lambda x: f"{x['tokens_per_s']:.0f} ({x['mean_accepted']:.2f})"  # noqa: E731
        busy, per = d["gpu_busy"], d["loop"]["launches_per_64_tokens"]
        t.add_row(str(r["sequences"]), cell(d), cell(h), cell(s), f"{r['device_over_host_rounds']:.2f}",
                  f"{r['device_over_host_runner']:.2f}", "n/a" if busy is None else f"{100 * busy:.1f}%",
                  "-" if per is None else f"{per:.2f}", r["rounds_ran"],
                  ("yes" if r["tokens_equal"] else "NO")
                  + ("" if r.get("runner_tokens_equal", True) else "; runner: near ties")
                  + ("" if r["checks_ok"] else ", check FAILED"))
    return fit(t)


def toy_section(ctx) -> dict:
    """Section 7 on the toy (``ctx``: the bench's Context): 1 and 4 sequences at once on
    CUDA, 1 and 2 on a CPU."""
    light = ctx.quick or not ctx.graphs
    return run_section(ctx.model, graphs=ctx.graphs, seed=ctx.seed, sequences=(1, 2) if light else (1, 4),
                       requests=2 if light else 8, new=8 if light else 96)
