"""Chaos bench: SIGKILL each service of a supervised local topology in turn under load.

    .venv/bin/python bench/chaos.py [--per-phase 30] [--window 30] [--replicas 2]
        [--model M | --echo] [--targets none,llm-1,...]

Starts ``omniflow up`` (``--replicas`` routers and coordinators, 2 by default; two real
llm workers serving ``--model``, SmolLM2-135M-Instruct by default, greedy, ``--max-tokens``
per request — or, with ``--echo``, echo TEST workers whose requests cost almost nothing)
in a temporary run folder, records the answers (greedy: the same prompt, the same text),
then for each of llm-1, kv-agent, router, coordinator, kv-index and Redis: sends
``--per-phase`` requests (in turn: workflow runs by the Python client, direct generations
through the router's proxy, completions, llm chats and workflow-model chat turns through
the gateway), SIGKILLs the service a third of the way in, and counts how the requests ended (see
``omniflow.testing.chaos``). Prints the table, the load average, and why each request
that was not ok at the first try was not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from omniflow.testing.chaos import KILL_ORDER, NO_FAULT, chaos, table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--per-phase", type=int, default=30, help="requests per killed service (5 kinds x 6)"
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model of the real llm workers")
    p.add_argument("--echo", action="store_true", help="echo TEST workers instead of a model")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per real generation")
    p.add_argument("--spacing", type=float, default=0.08, help="seconds between requests")
    p.add_argument(
        "--window",
        type=float,
        default=0.0,
        help="recovery probe window, seconds (0: 10 with --echo, 30 with real workers, so that "
        "a recovery past the 10 s target on a loaded machine is measured, not cut off)",
    )
    p.add_argument(
        "--targets",
        default=",".join((NO_FAULT, *KILL_ORDER)),
        help=f"services to kill, in order ({NO_FAULT}: a control phase with the load, no kill)",
    )
    p.add_argument(
        "--replicas", type=int, default=2, help="routers and coordinators each (1: no failover)"
    )
    p.add_argument(
        "--budget",
        type=float,
        default=450.0,
        help="seconds after which no further phase starts (the ones left are listed as skipped "
        "and the exit status is 1): the default run ends within 10 minutes",
    )
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="omniflow-chaos-") as tmp:
        result = asyncio.run(
            chaos(
                Path(tmp),
                per_phase=args.per_phase,
                targets=tuple(args.targets.split(",")),
                window_s=args.window or (10.0 if args.echo else 30.0),
                replicas=args.replicas,
                model="" if args.echo else args.model,
                max_tokens=args.max_tokens,
                spacing_s=args.spacing,
                budget_s=args.budget or None,
            )
        )
    phases, stuck = result.phases, result.stuck
    workers = "echo TEST workers" if args.echo else f"real llm workers ({args.model}, greedy)"
    print(f"\n{args.replicas} router(s) and {args.replicas} coordinator(s), supervised; {workers}")
    print(table(phases))
    for prompt, text in result.answers.items():  # what the workers answer
        print(f"  answer recorded before the faults: ...{prompt[-40:]!r} -> {text!r}")
    if result.skipped:
        print(f"\nskipped (past --budget {args.budget:.0f} s): {', '.join(result.skipped)}")
    print(f"\nruns left RUNNING after the adoption window: {len(stuck)}")
    print(f"processes omniflow down left behind: {len(result.left_behind)}")
    print(f"wall time {time.monotonic() - started:.0f} s; load average {os.getloadavg()}")
    for phase in phases:  # why each request that was not ok at the first try was not
        for note in phase.notes:
            print(f"  {phase.killed}: {note}")
    bad = (
        stuck
        or result.skipped
        or result.left_behind
        or any(p.counts["lost"] or p.counts["wrong"] or p.recovery_s is None for p in phases)
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
