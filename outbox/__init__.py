"""outbox: a transactional outbox with idempotent side effects on PostgreSQL.

Write business rows and the effects they call for in one transaction
(``outbox.transaction(conn).enqueue(...)``); a ``Dispatcher`` performs each effect outside
any transaction and records it in the effect ledger together with the fenced
``running -> done`` update. Delivery to an effect is at least once; with a provider that
honours idempotency keys, the effect happens once.

``AsyncDispatcher`` is the same dispatcher on one asyncio event loop (psycopg
``AsyncConnection``), with the same options, statements and guarantees: fenced writes,
leases heartbeated while effects run, expired leases rescued, at most ``concurrency``
performs at once (sync effects on a bounded thread pool, async ones on the loop), and on
``stop()`` or cancellation in-flight work finished or handed back with its attempt
refunded.
"""

from ._after import FailedParent
from ._enqueue import EnqueueResult, NewJob
from ._lifecycle import Backoff
from .dispatcher import AsyncDispatcher, Dispatcher, DispatchStats
from .effect import Effect, Job
from .errors import (
    ConfigurationError,
    DispatcherFailed,
    EffectOutcome,
    EnqueueError,
    IdempotencyKeyConflict,
    InvalidArgument,
    InvalidKey,
    InvalidPayload,
    OutboxError,
    Permanent,
    ReadOnlyDatabase,
    Retry,
    SchemaError,
    Throttled,
    UnknownEffect,
    UnknownOutcome,
    UnknownParent,
)
from .flows import AsyncHookTransaction, HookTransaction, NotPerformed, Performed
from .limits import Limit
from .migrate import migrate
from .registry import register_effects
from .schedules import Schedule
from .targets import Target
from .transaction import AsyncTransaction, Transaction, transaction

__all__ = [
    "AsyncDispatcher",
    "AsyncHookTransaction",
    "AsyncTransaction",
    "Backoff",
    "ConfigurationError",
    "DispatchStats",
    "Dispatcher",
    "DispatcherFailed",
    "Effect",
    "EffectOutcome",
    "EnqueueError",
    "EnqueueResult",
    "FailedParent",
    "HookTransaction",
    "IdempotencyKeyConflict",
    "InvalidArgument",
    "InvalidKey",
    "InvalidPayload",
    "Job",
    "Limit",
    "NewJob",
    "NotPerformed",
    "OutboxError",
    "Performed",
    "Permanent",
    "ReadOnlyDatabase",
    "Retry",
    "Schedule",
    "SchemaError",
    "Target",
    "Throttled",
    "Transaction",
    "UnknownEffect",
    "UnknownOutcome",
    "UnknownParent",
    "migrate",
    "register_effects",
    "transaction",
]
