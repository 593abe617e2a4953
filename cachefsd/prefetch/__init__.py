"""Prefetch: the access model (``access.py``: pure, fed with open/read/list
events, predicts what is read next) and the prefetcher that turns its
predictions into block fetches within one global budget (``engine.py``)."""
