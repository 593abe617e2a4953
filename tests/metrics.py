"""Reading a metric in a test: by the name it is exported under, through
the registry's public API (``get_sample_value``), never prometheus-client's
internals."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with exactly ``labels``; the test
    fails if ``registry`` has no such sample (a misspelt name is not a 0)."""
    value = registry.get_sample_value(name, labels)
    if value is None:
        pytest.fail(f"no sample {name}{labels} in the registry")
    return value
