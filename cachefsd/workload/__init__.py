"""The workload model: which jobs read which datasets, in what epochs and
orders, and what each will read next, learned from a mount's events. Pure
logic, no I/O and no clock: the prefetcher asks it what to fetch, the
eviction policy reads it as its epoch clock, the filesystem asks it
whether another job is still to read a file (and marks that read's blocks
for the policy), and ``stats`` and ``cachefsd doctor`` report from it.

``model.py`` is the façade a mount uses (``WorkloadModel``); it composes
``identity.py`` (jobs and their workloads), ``epochs.py`` (a workload's
passes and unread files), ``plans.py`` (orders to follow, and trust) and
``streams.py`` (sequential reads inside large files)."""
