"""The dispatcher's parts, each in its own module (River's services, in threads)::

    options     the options declared once: default, text, unit, and who reads each
    settings    the options, validated once (frozen), shared by both dispatchers
    held        a claimed job in hand, and the outcome of its attempt
    state       what the parts share (``SharedState``), with named transitions and a stated
                owner per field; the stop and its ``stop_timeout`` (``abandon``)
    signals     how parts wait and limit: ``Timer``, the signal of each flavour
                (``threading.Event``, ``LoopEvent``), ``Slots`` (the concurrency limit)
    runtime     the loops written once: programs yielding instructions (run a step, wait,
                back off, call), driven on a thread (``drive``) or as a task
                (``drive_async``)
    supervision every part supervised (its death stops the dispatcher loudly), and
                ``guarded`` observer calls
    serving     a run written once: the order the parts start and end in, the claimer,
                the drain, failures surfaced; each flavour's threads or tasks
    connection  how connections are opened (one function) and replaced when they break
    network     the timeouts and keepalives every connection gets, under the DSN's own
    standby     a standby (or read-only server) reached: refused as a connection opens,
                said once per host
    severance   a stop that ends while the database hangs: connections cut at
                stop_timeout; its watch one program for both flavours
    watchdog    a server that stops answering while running: a waiting statement's
                server asked, said and its connections cut when it does not answer
    claimer     claim batches, rescue expired leases, retention
    rescuer     expired leases settled as unknown outcomes (``outbox._lifecycle.expired``),
                applied by the recorder's fenced ``settle``, with their on_failed hooks
    turns       where this dispatcher's last claim stopped among each effect's groups
    budget      provider limits as the dispatcher spends them (``outbox.limits`` declares
                them): budgeted claims, throttles, the breaker
    shared      limits shared across targets: the token buckets in the limits home
    workers     run ``perform`` within the one concurrency limit
    recorder    complete / settle batches (fenced), heartbeat held leases; the
                settlement itself is ``outbox._lifecycle.settle``
    hooked      the recorder's per-job path for outcomes with a completion hook, and
                how a hook is called in a transaction
    collector   Python's cyclic garbage collector paused around a burst of allocation
                (a claim's jobs made, a chunk's hooks called), counted across threads
    settling    the claims ``settle`` applies, each with its decision and the one for a
                claim an operator cancelled meanwhile (``_lifecycle.cancelled_meanwhile``)
    hook_lookup which effects have completion hooks and reconcilers (build time)
    reconciler  ask the provider about jobs in ``reconcile``, write its answer
    flowsql     the named blocks of ``sql/flows.sql`` (hooks and reconciler)
    scheduler   enqueue the due slots of the schedules (``outbox.schedules``), each once
    presence    this dispatcher's heartbeat row, and warnings for effects nobody serves
    statistics  the young queue tables' statistics, kept up with their growth until
                autovacuum keeps them
    vacuum      the queue tables' dead rows vacuumed between autovacuum's visits
    replicas    wait_for_replicas: a claimed batch waits until the standbys hold its
                commit
    listener    LISTEN for enqueue notifications, wake the claimer
    awake       a busy claimer's mark, so enqueues of its effects need not notify, taken
                away behind a fence before it sleeps
    cancellation tell performs to stop (``job.cancelled``): an operator's cancel, a lost
                claim or lease, a timeout; the watcher that sets it on time
    counting    ``DispatchStats``, counted from the observer events the parts report
    fleet       one dispatcher over many targets (``outbox.targets``): look-outs per
                database, turns of each target's own engine, isolation of failing ones
    crew        the threads and connections a fleet's turns share (long-lived, pooled)
    looks       a fleet's polled databases: the look (a step), and the skip of those whose
                server's counters show nothing new since their last look; its listened
                schemas: the question, and the skip of those where nothing may have
                changed since their last look

Their database work is written once as steps (``outbox._steps``), and their loops once as
programs (``runtime``): the claimer's ``claiming``, the recorder's ``recording``, the
scheduler's ``scheduling``, the reconciler's ``reconciling``, the listener's ``listening``,
the watcher's ``watching``. A run is one program too (``serving.serve``): it starts them,
runs the claimer and the drain, and ends them, in one order for both dispatchers.
``Dispatcher`` drives it on the caller's thread, its parts on threads, and
``AsyncDispatcher`` as a task, its parts as tasks (``outbox.dispatcher``'s ``_Threads`` and
``_Tasks``: what differs by flavour lives there and in the two drivers only).
"""
