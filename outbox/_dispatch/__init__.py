"""The dispatcher's parts, each in its own module (River's services, in threads)::

    settings    the options, validated once (frozen), shared by both dispatchers
    state       what the parts share, with named transitions and a stated owner per field
    connection  how connections are opened (one function) and replaced when they break
    claimer     claim batches, rescue expired leases, retention
    workers     run ``perform`` within the one concurrency limit
    recorder    complete / settle batches (fenced), heartbeat held leases
    listener    LISTEN for enqueue notifications, wake the claimer
    counting    ``DispatchStats`` counted from the observer events the parts report

Their database work is written once as steps (``outbox._steps``), driven on threads or
on asyncio. ``outbox.dispatcher.Dispatcher`` builds, starts and joins them.
"""
