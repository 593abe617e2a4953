"""Prefetch: the access model (``access.py``: pure, fed with open/read/list
events, predicts what is read next) and the prefetcher that turns its
predictions into block fetches within one global budget (``engine.py``),
composed of one module per mechanism: the reach (``reach.py``), the
bandwidth cap (``bucket.py``), the in-flight accounting (``accounts.py``), a
large file's first run (``head.py``) and page-cache warming (``warm.py``),
with their numbers in ``tuning.py``."""
