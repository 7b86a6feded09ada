"""A dispatcher process for the tests of limits shared across targets:
``python -m tests.targets.shared_worker --target DSN#SCHEMA ... --home DSN#SCHEMA
--limit 10/s,burst=1,shared --together N``.

Serves its targets (one: a plain dispatcher; several: a fleet) with one effect,
``shared.quick`` (returns at once), under the limit given, counted in the home. It waits
until ``--together`` workers have signed in to the home's ``limit_ready`` table
(``tests.limits.worker.wait_for_each_other``), so that every
process claims while the others do, then runs ``run_until_idle`` and prints its stats as
JSON.
"""

from __future__ import annotations

import argparse
import json

import outbox
from outbox.limits import parse_limit
from outbox.targets import parse_target
from tests.limits.worker import wait_for_each_other

QUICK_EFFECT = "shared.quick"


class Quick(outbox.Effect):
    """Succeeds at once."""

    name = QUICK_EFFECT

    def perform(self, job: outbox.Job) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", action="append", required=True)
    parser.add_argument("--home", required=True)
    parser.add_argument("--limit", required=True)
    parser.add_argument("--together", type=int, default=1)
    args = parser.parse_args()
    targets = [parse_target(text) for text in args.target]
    home = parse_target(args.home)
    limits = {QUICK_EFFECT: parse_limit(args.limit)}
    options = {"limits": limits, "limits_home": home, "poll_interval": 0.1}
    if len(targets) == 1:
        dispatcher = outbox.Dispatcher(targets[0].dsn, [Quick()], schema=targets[0].schema,
                                       **options)  # type: ignore[arg-type]
    else:
        dispatcher = outbox.Dispatcher(effects=[Quick()], targets=targets,
                                       **options)  # type: ignore[arg-type]
    wait_for_each_other(home.dsn, home.schema, args.together)
    stats = dispatcher.run_until_idle(timeout=120)
    print(json.dumps(stats.as_dict()))


if __name__ == "__main__":
    main()
