"""What the CPU kernels' preparers share (see gradgen/kernels/table.py, ``cpu_prepare``).

A preparer resolves at plan time what the node's attributes and constant inputs fix; what depends on
the input shapes (a reshape target, slice bounds, a reduction's count) it works out on the first
call with each shape and keeps, so the steps that follow cost a dict lookup and the numpy call.
"""

from __future__ import annotations

from typing import Callable, Hashable, TypeVar

from gradgen.kernels.table import RUNTIME

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

_LIMIT = 64  # shapes kept per node; a model whose shapes change every run starts over past this


def per_shape(compute: Callable[[K], T]) -> Callable[[K], T]:
    """``key -> compute(key)``, computed once per key (a shape, or a tuple of shapes) and kept;
    errors are raised again on the next call, not kept."""
    cache: dict = {}

    def lookup(key: K) -> T:
        found = cache.get(key)
        if found is None:
            if len(cache) >= _LIMIT:
                cache.clear()
            found = cache[key] = compute(key)
        return found

    return lookup


class OwnSums:
    """Marks a plan whose results are not the kernel's bits (another library's sums, equal within
    rounding): ``kernel_first`` returns the plan's result from the first call on, so that every
    run with a signature gives the same bits."""


def kernel_first(kernel: Callable, signature: Callable, make_plan: Callable, fast: Callable, limit: int = 16) -> Callable:
    """A prepared call that keeps a plan per input signature (shapes and dtypes): the first call
    with a signature runs ``kernel(*args)`` (its checks, its errors, its result) and then keeps
    ``make_plan(*args)``; later calls run ``fast(plan, *args)``, or the kernel again where the plan
    is False (too large to keep). ``limit`` signatures are kept (each plan may hold an index). A
    plan marked ``OwnSums`` gives the first call's result too (the kernel ran for its checks)."""
    plans: dict = {}

    def run(*args):
        key = signature(*args)
        plan = plans.get(key)
        if plan is None:
            result = kernel(*args)
            if len(plans) >= limit:
                plans.clear()
            plan = plans[key] = make_plan(*args)
            return fast(plan, *args) if isinstance(plan, OwnSums) else result
        if plan is False:
            return kernel(*args)
        return fast(plan, *args)

    return run


def constant_inputs(constants: tuple, *indices: int) -> list | None:
    """The plan-time values of the inputs at ``indices`` (None for an absent one), or None when one
    of them is computed at run time."""
    values = [constants[i] if i < len(constants) else None for i in indices]
    return None if any(v is RUNTIME for v in values) else values
