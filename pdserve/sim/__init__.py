"""A discrete-event simulator of a whole pdserve deployment (docs/simulator.md).

``trace`` (the load tester's requests and send times) -> ``cluster.simulate`` (router, pools of
``worker.SimWorker`` timed by ``timing.WorkerTiming``, KV links, leases) -> ``results`` (the
load tester's metrics). ``search`` is ``pdserve plan --simulate``'s use of it.
"""
