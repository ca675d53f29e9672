"""The CUDA launcher toolkit every family uses: plan caches keyed by host values, ...

Importing it needs no GPU; the functions that touch the device import gradgen.cuda.runtime when
they run.
"""

from __future__ import annotations

import numpy as np

PLAN_CACHE_LIMIT = 4096  # plans per cache before it is cleared (shapes seen by one process)


def host_key(a):
    """A hashable key for a small host array (shape, axes, starts, ...), None for an omitted input."""
    if a is None:
        return None
    a = np.asarray(a)
    return a.dtype.char, a.shape, a.tobytes()


def plan_cache(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` on a miss (a bounded dict: cleared when it grows too big)."""
    plan = cache.get(key)
    if plan is None:
        plan = make()
        if len(cache) > PLAN_CACHE_LIMIT:
            cache.clear()
        cache[key] = plan
    return plan
