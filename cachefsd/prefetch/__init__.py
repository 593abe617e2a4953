"""Prefetch: the prefetcher (``prefetcher.py``) that turns the workload
model's predictions (``cachefsd/workload/``) into block fetches within one
global budget, composed of one module per mechanism: the reach
(``reach.py``), the bandwidth cap (``bucket.py``), the in-flight accounting
(``accounts.py``), a large file's first run (``head.py``) and page-cache
warming (``warm.py``), with their numbers in ``tuning.py``."""
