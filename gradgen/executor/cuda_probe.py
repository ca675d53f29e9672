"""Whether a CUDA GPU can be used here, without importing the CUDA stack unless asked."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cuda_unavailable_reason() -> str | None:
    """None when PyCUDA imports and a GPU answers; otherwise a short reason."""
    try:
        import pycuda.driver as driver
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"PyCUDA is not importable: {exc}; install gradgen[cuda]"
    try:
        driver.init()
        if driver.Device.count() == 0:
            return "no CUDA device found"
    except Exception as exc:
        return f"CUDA driver error: {exc}"
    return None
