"""Whether a CUDA GPU can be used here, without importing the CUDA stack unless asked."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cuda_unavailable_reason() -> str | None:
    """None when PyCUDA imports and a GPU answers; otherwise a short reason."""
    try:
        import pycuda.driver as driver
    except ImportError:
        return "PyCUDA is not installed; pip install 'gradgen[cuda]'"
    except Exception as exc:  # a broken install can raise anything at import
        return f"PyCUDA failed to import: {exc}"
    try:
        driver.init()
        if driver.Device.count() == 0:
            return "no CUDA device found"
    except Exception as exc:
        return f"CUDA driver error: {exc}"
    return None
