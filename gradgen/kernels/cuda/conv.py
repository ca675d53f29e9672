"""CUDA launchers: Conv and com.microsoft ConvGrad through cuDNN (nvidia-cudnn-frontend).

Geometry comes from the CPU kernel's ``conv_geometry`` (auto_pad SAME_UPPER/SAME_LOWER/VALID
resolved to explicit pads), so both devices agree. 1-D convolutions run as 2-D ones with a unit
axis. cuDNN gets symmetric padding only: an asymmetric pad is applied by copying X into a
zero-padded buffer (and dX is cropped out of the padded gradient). One cuDNN graph is built per
(operation, dtype, shapes, attributes) and cached with its workspace size; each execution takes
its workspace as a scratch buffer of its step (planned memory during a Session's run, else the
PyCUDA pool), so no plan keeps memory between calls. Graphs are built without TF32 for float32
(GRADGEN_ALLOW_TF32=1 allows it) and without engines cuDNN marks non-deterministic
(GRADGEN_ALLOW_NONDETERMINISTIC=1 allows them). Among those, every candidate plan is timed once
per graph on the real buffers and the fastest kept (cuDNN's heuristics pick slow deterministic
engines for several of ResNet-18's passes: its step took 18.3 ms with them, 17.0 ms autotuned, on
an H100); candidates whose workspace exceeds AUTOTUNE_WORKSPACE_LIMIT are skipped, their scratch is
allocated outside gradgen's pool and freed at once, and nothing is timed while a CUDA graph is being
captured (heuristics then). GRADGEN_CUDNN_BENCHMARK=0 keeps cuDNN's heuristic choice.
After a plan's first run through the frontend's public execute, later runs call the lowered backend
graph directly (the frontend's own uid-map call), which saves most of the per-call Python cost.

Where cuDNN declines a configuration (or is missing), direct convolution kernels (conv.cu) run
instead, with a one-time warning: one thread per output for the forward pass and dX, one block
per weight element for dW, all deterministic. dB is a per-channel block reduction of dY.

Col2Im is a ConvTranspose with one-hot kernels (the transpose of the im2col that its gradient is).
"""

from __future__ import annotations

import math
import os

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cuda.elementwise import cast_to, in_float32
from gradgen.kernels.cuda.launch import (
    contiguous,
    cpu_fallback,
    dtype_suffix,
    element_strides,
    is_float,
    kernel_of,
    launch,
    left_pad,
    plan_cache,
    require_suffix,
    runtime,
    tf32_allowed,
    warn_once,
)
from gradgen.kernels.table import MICROSOFT, cuda_kernel
from gradgen.ops.conv import col2im_channels, col2im_geometry

FORCE_DIRECT = False  # tests set this to exercise the direct kernels
FAST_EXECUTE = True  # execute cuDNN plans through the frontend's ordered (uid tuple) form
NATIVE_EXECUTE = True  # after the first execute, call the lowered backend graph directly
# ConvGrad: dX on one side stream while dW and dB run on another. Measured on an H100 at N=32,
# C=K=256, 14x14: no gain over one stream (each cuDNN kernel fills the GPU), so off by default.
CONCURRENT = False
AUTOTUNE_WORKSPACE_LIMIT = 256 << 20  # bytes: a faster plan that needs more scratch is not worth the memory
_STATE: dict = {}
_GRAPHS: dict = {}
SPATIAL = 3  # spatial axes the direct kernels handle (conv.cu's GG_SP)
CONV_GEOM = np.dtype(
    [(f, np.int64) for f in ("n", "c", "m", "g")] + [(f, np.int64, SPATIAL) for f in ("inp", "out", "k", "s", "d", "pb")]
)


def _flag(name: str) -> bool:
    return os.environ.get(name, "") == "1"


# ---------------------------------------------------------------------------------------------
# cuDNN graphs


def _cudnn():
    """(module, handle): the cudnn frontend and one handle per process, on gradgen's stream."""
    if "handle" not in _STATE:
        import cudnn

        from gradgen.cuda import runtime as rt  # noqa: F401  (the primary context is current)

        _STATE["cudnn"] = cudnn
        _STATE["handle"] = cudnn.create_handle()
        try:
            cudnn.set_stream(_STATE["handle"], int(rt.stream().handle))
        except Exception:  # noqa: BLE001 - a fresh handle already runs on the default stream
            pass
    return _STATE["cudnn"], _STATE["handle"]


def _lane(lane: int):
    """(stream or None, cudnn handle) of a lane: 0 is the default stream; 1 and 2 are blocking side
    streams (they wait for earlier default-stream work, and later default-stream work waits for them)."""
    cudnn, handle = _cudnn()
    if lane == 0:
        return None, handle
    if "lanes" not in _STATE:
        from gradgen.cuda import runtime as rt

        lanes = []
        for _ in range(2):
            stream = rt.driver.Stream()
            side = cudnn.create_handle()
            cudnn.set_stream(side, int(stream.handle))
            lanes.append((stream, side))
        _STATE["lanes"] = lanes
    return _STATE["lanes"][lane - 1]


class _Plan:
    """A built cuDNN graph: its two input tensors, its output tensor, its workspace size in bytes."""

    def __init__(self, graph, a, b, out, workspace, note="", handle=None):
        self.graph, self.a, self.b, self.out, self.workspace = graph, a, b, out, workspace
        self.handle = handle
        self.note = note  # how the plan was chosen (heuristics, autotune result)
        self._native = None  # the direct backend call, set up after the first execute (False: unusable)
        self.uids = None
        if FAST_EXECUTE:
            try:
                self.uids = (int(a.uid), int(b.uid), int(out.uid))
            except Exception:  # noqa: BLE001
                self.uids = None

    def name(self) -> str:
        try:
            return str(self.graph.get_plan_name_at_index(self.graph._plan_index))
        except Exception as exc:  # noqa: BLE001
            return f"<unknown: {exc}>"

    def _native_executor(self):
        """Execute the built backend plan straight through the lowered graph (the frontend's own
        uid-map call, without its per-call Python bookkeeping); None where that is not possible."""
        g = self.graph
        if g.selected_engine is not None or getattr(g, "_data_bindings", None):
            return None
        lowered = g._lowered_graph
        cfg = g._materialize_backend_plan(g._plan_index) if g._plans else None
        index = cfg.cpp_index if cfg is not None else None
        backend = self.handle.backend_handle if self.handle is not None else _cudnn()[1].backend_handle
        uids = (int(self.a.uid), int(self.b.uid), int(self.out.uid))
        if index is None:

            def call(a_ptr, b_ptr, out_ptr, ws):
                lowered._execute(dict(zip(uids, (a_ptr, b_ptr, out_ptr))), ws, backend, None, None, None)
        else:

            def call(a_ptr, b_ptr, out_ptr, ws):
                lowered._execute_plan_at_index(dict(zip(uids, (a_ptr, b_ptr, out_ptr))), ws, index, backend, None, None, None)

        return call

    def run(self, out_ptr: int, a_ptr: int, b_ptr: int, keep: list | None = None) -> None:
        """Execute on the given device addresses; ``keep`` (a concurrent section's list) holds the
        workspace until its side streams are joined."""
        from gradgen.cuda import runtime as rt

        handle = self.handle if self.handle is not None else _cudnn()[1]
        scratch = rt.empty((self.workspace,), np.uint8) if self.workspace else None  # lives until we return
        ws = int(scratch.gpudata) if scratch is not None else None
        if keep is not None and scratch is not None:
            keep.append(scratch)
        if self._native:
            try:
                self._native(int(a_ptr), int(b_ptr), int(out_ptr), ws or 0)
                return
            except Exception:  # noqa: BLE001 - fall back on the frontend's public execute
                self._native = False
        if self.uids is not None:
            try:
                self.graph.execute((int(a_ptr), int(b_ptr), int(out_ptr)), ws, handle=handle, tensor_uids=self.uids)
            except Exception:  # noqa: BLE001 - this frontend has no ordered path: use the mapping form
                self.uids = None
        if self.uids is None:
            self.graph.execute({self.a: int(a_ptr), self.b: int(b_ptr), self.out: int(out_ptr)}, ws, handle=handle)
        if self._native is None and NATIVE_EXECUTE:
            try:
                self._native = self._native_executor() or False
            except Exception:  # noqa: BLE001
                self._native = False


def _data_types(cudnn, dtype):
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return cudnn.data_type.DOUBLE, cudnn.data_type.DOUBLE
    if dtype == np.float16:
        return cudnn.data_type.HALF, cudnn.data_type.FLOAT
    if dtype_suffix(dtype) == "bf16":
        return cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    return cudnn.data_type.FLOAT, cudnn.data_type.FLOAT


def _build(
    kind,
    dtype,
    a_dims,
    b_dims,
    out_dims,
    pads,
    strides,
    dilations,
    tf32,
    nondet,
    bench_ptrs=None,
    lane=0,
    choice_key="",
    out_dtype=None,
):
    """``out_dtype``: the output's element type where it is not ``dtype`` (16-bit operands into a
    float32 output: the accumulator stored without the 16-bit rounding)."""
    cudnn, _ = _cudnn()
    _, handle = _lane(lane)
    io, compute = _data_types(cudnn, dtype)
    out_io = io if out_dtype is None else _data_types(cudnn, out_dtype)[0]
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=compute, compute_data_type=compute, handle=handle)
    a = graph.tensor(name="A", dim=list(a_dims), stride=runtime().contiguous_strides(a_dims), data_type=io)
    b = graph.tensor(name="B", dim=list(b_dims), stride=runtime().contiguous_strides(b_dims), data_type=io)
    conv = dict(
        pre_padding=list(pads),
        post_padding=list(pads),
        stride=list(strides),
        dilation=list(dilations),
        compute_data_type=compute,
        name=kind,
    )
    if kind == "fprop":
        out = graph.conv_fprop(image=a, weight=b, **conv)
    elif kind == "dgrad":
        out = graph.conv_dgrad(loss=a, filter=b, **conv)
    else:
        out = graph.conv_wgrad(image=a, loss=b, **conv)
    out.set_output(True).set_data_type(out_io).set_dim(list(out_dims)).set_stride(runtime().contiguous_strides(out_dims))
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    notes = []
    if not nondet:
        notes.append(cudnn.numerical_note.NONDETERMINISTIC)
    if np.dtype(dtype) == np.float32 and not tf32:
        notes += [cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS]
    if notes:
        graph.deselect_numeric_notes(notes)
    graph.check_support()
    if bench_ptrs is not None:
        plan = _tuned_earlier(graph, a, b, out, handle, choice_key) if choice_key else None
        if plan is None:
            plan = _autotune(graph, a, b, out, bench_ptrs, handle, _lane(lane)[0])
            if plan is not None and choice_key:
                _remember_choice(choice_key, plan.name())
        if plan is not None:
            return plan
    graph.build_plans()
    return _Plan(graph, a, b, out, int(graph.get_workspace_size()), note="heuristics", handle=handle)


# ---------------------------------------------------------------------------------------------
# The tuned choices, kept on disk (the kernel cache directory) so that every process on a machine
# runs the plan the first one timed fastest: timing noise could otherwise pick another deterministic
# engine in the next process, whose results round differently.

_CHOICES_FILE = "cudnn-plans.json"


def _choices_path():
    from gradgen.cuda.kernel_cache import cache_dir

    return cache_dir() / _CHOICES_FILE


def _machine_key() -> str:
    """The GPU and cuDNN a choice was timed on."""
    from gradgen.cuda import runtime as rt

    cudnn, _ = _cudnn()
    try:
        version = str(cudnn.backend_version())
    except Exception:  # noqa: BLE001
        version = getattr(cudnn, "__version__", "?")
    return f"{rt.driver.Context.get_device().name()}|cudnn {version}"


def _load_choices() -> dict:
    import json

    if "choices" not in _STATE:
        try:
            _STATE["choices"] = json.loads(_choices_path().read_text())
        except (OSError, ValueError):
            _STATE["choices"] = {}
    return _STATE["choices"]


def _remember_choice(key: str, plan_name: str) -> None:
    import json

    from gradgen.cuda.kernel_cache import atomic_write

    choices = _load_choices()
    choices[f"{_machine_key()}|{key}"] = plan_name
    try:
        path = _choices_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        try:  # keep what other processes wrote meanwhile
            merged = {**json.loads(path.read_text()), **choices}
        except (OSError, ValueError):
            merged = choices
        atomic_write(path, json.dumps(merged, indent=0, sort_keys=True).encode())
    except OSError:  # no writable cache: the choice holds for this process only
        pass


def _tuned_earlier(graph, a, b, out, handle, key: str):
    """The plan an earlier process timed fastest for this graph, built; None where none is known
    (or it is no longer among the candidates)."""
    name = _load_choices().get(f"{_machine_key()}|{key}")
    if name is None:
        return None
    cudnn, _ = _cudnn()
    try:
        graph.build_plans(cudnn.build_plan_policy.ALL)
        for index in range(graph.get_execution_plan_count()):
            if str(graph.get_plan_name_at_index(index)) == name:
                graph.select_plan(index)
                graph.build_plans()
                return _Plan(graph, a, b, out, int(graph.get_workspace_size()), handle=handle, note=f"tuned earlier: {name}")
    except Exception:  # noqa: BLE001 - time the candidates afresh
        return None
    return None


def _autotune_wanted() -> bool:
    """Time the candidate plans: by default (GRADGEN_CUDNN_BENCHMARK=0 turns it off), never while a
    CUDA graph is being captured (the timing runs and syncs cannot be captured)."""
    from gradgen.cuda import runtime as rt

    return os.environ.get("GRADGEN_CUDNN_BENCHMARK", "1") != "0" and not rt.CAPTURE.active


def _autotune(graph, a, b, out, ptrs, handle, stream):
    """Build every candidate plan, time each on the real buffers, keep the fastest (None: give up)."""
    from gradgen.cuda import runtime as rt

    cudnn, _ = _cudnn()
    rt.synchronize()
    try:
        graph.build_plans(cudnn.build_plan_policy.ALL)
        best = None
        start, stop = rt.driver.Event(), rt.driver.Event()
        pack = {a: int(ptrs[1]), b: int(ptrs[2]), out: int(ptrs[0])}
        for index in range(graph.get_execution_plan_count()):
            ws = None
            try:
                size = int(graph.get_workspace_size_plan_at_index(index))
                if size > AUTOTUNE_WORKSPACE_LIMIT:
                    continue
                ws = rt.driver.mem_alloc(size) if size else None  # outside the pool: freed below, not cached
                wptr = int(ws) if ws is not None else None
                graph.execute_plan_at_index(pack, wptr, index, handle)
                start.record(stream)
                for _ in range(3):
                    graph.execute_plan_at_index(pack, wptr, index, handle)
                stop.record(stream)
                stop.synchronize()
                ms = stop.time_since(start)
            except Exception:  # noqa: BLE001 - a plan that did not build or run is skipped
                continue
            finally:
                if ws is not None:
                    stop.synchronize()
                    ws.free()
            if best is None or ms < best[0]:
                best = (ms, index)
        if best is None:
            _STATE["autotune_error"] = "no plan ran"
            return None
        graph.select_plan(best[1])
        graph.build_plans()
        rt.synchronize()
        return _Plan(
            graph,
            a,
            b,
            out,
            int(graph.get_workspace_size()),
            handle=handle,
            note=f"autotuned: plan {best[1]} of {graph.get_execution_plan_count()}, {best[0] / 3:.3f} ms",
        )
    except Exception as exc:  # noqa: BLE001
        _STATE["autotune_error"] = f"{type(exc).__name__}: {exc}"
        return None


def _plan(kind, dtype, a_dims, b_dims, out_dims, pads, strides, dilations, ptrs, lane=0, out_dtype=None):
    """The cached cuDNN plan for this convolution, or None where cuDNN declines it (``out_dtype``:
    see ``_build``)."""
    tf32, nondet = tf32_allowed(), _flag("GRADGEN_ALLOW_NONDETERMINISTIC")
    out_dtype = None if out_dtype is None or np.dtype(out_dtype) == np.dtype(dtype) else np.dtype(out_dtype)
    key = (
        kind,
        np.dtype(dtype).str if out_dtype is None else f"{np.dtype(dtype).str}->{out_dtype.str}",
        tuple(a_dims),
        tuple(b_dims),
        tuple(out_dims),
        tuple(pads),
        tuple(strides),
        tuple(dilations),
        tf32,
        nondet,
        lane,
    )
    if key not in _GRAPHS:
        bench = ptrs if _autotune_wanted() else None
        try:
            _GRAPHS[key] = _build(
                kind,
                dtype,
                a_dims,
                b_dims,
                out_dims,
                pads,
                strides,
                dilations,
                tf32,
                nondet,
                bench,
                lane,
                repr(key[:-1]),
                out_dtype,
            )
        except ImportError as exc:
            _GRAPHS[key] = None
            _warn("cudnn-import", f"cuDNN is not available ({exc}); convolutions run on gradgen's direct kernels")
        except Exception as exc:  # noqa: BLE001 - cuDNN declined: the direct kernels serve it
            _GRAPHS[key] = None
            into = "" if out_dtype is None else f" into {out_dtype}"
            instead = (
                "running gradgen's direct convolution kernel for it"
                if out_dtype is None
                else f"convolving its operands cast up to {out_dtype} instead"
            )
            _warn(
                f"cudnn-{kind}-{np.dtype(dtype)}{into}",
                f"cuDNN declined a {np.dtype(dtype)} conv {kind}{into} ({type(exc).__name__}: {str(exc)[:200]}); {instead}",
            )
    return _GRAPHS[key]


def _warn(key, message):
    warn_once(key, message)


# ---------------------------------------------------------------------------------------------
# device helpers of the conv launchers (conv.cu): padding copies, channel sums, bias


def barrier() -> None:
    """An empty launch on the default stream: it waits for every blocking side stream's earlier work."""
    kernel_of("conv", "noop")(np.int64(0), block=(1, 1, 1), grid=(1, 1))


def window_copy(src, out_shape, shift=None, view_strides=None, view_shape=None, stream=None):
    """A new C-contiguous array of ``out_shape``: out[o] = src[o + shift] inside src, 0 outside.

    ``view_strides``/``view_shape`` read ``src`` through other strides (0 for a broadcast axis).
    """
    from gradgen.cuda import runtime as rt

    out_shape = tuple(int(d) for d in out_shape)
    out = rt.empty(out_shape, src.dtype)
    if out.size == 0:
        return out
    rank = len(out_shape)
    view_shape = list(src.shape) if view_shape is None else list(view_shape)
    view_strides = element_strides(src) if view_strides is None else list(view_strides)
    if rank == 0:
        out_shape_desc, view_shape, view_strides = (1,), [1], [0]
        rank = 1
    else:
        out_shape_desc = out_shape
    shift = [0] * rank if shift is None else [int(s) for s in shift]
    kernel = kernel_of("conv", f"window_copy_{require_suffix(src.dtype)}")
    launch(
        kernel,
        out.size,
        out,
        src,
        rt.desc(out_shape_desc),
        rt.desc(view_shape, view_strides),
        rt.desc(shift),
        np.int64(out.size),
        stream=stream,
    )
    return out


def channel_sum(x, out=None, stream=None, keep=None):
    """Sum of an (N, C, ...) array over every axis but 1: per-(channel, row range) block partial sums,
    then one ordered sum per channel (deterministic; the partition depends on the shape only)."""
    from gradgen.cuda import runtime as rt

    x = contiguous(x)
    c = int(x.shape[1])
    outer, inner = int(x.shape[0]), math.prod(int(d) for d in x.shape[2:])
    if out is None:
        out = rt.empty((c,), x.dtype)
    if c == 0:
        return out
    if outer * inner == 0:
        rt.memset_zero(out)
        return out
    # Enough blocks to fill the GPU (about 1024 of them), each at least a few thousand elements.
    splits = max(1, min(outer, -(-1024 // c), max(1, (outer * inner) // 2048)))
    acc = np.float64 if x.dtype == np.float64 else np.float32
    partial = rt.empty((c * splits,), acc)
    if keep is not None:
        keep.append(partial)
    sfx = require_suffix(x.dtype)
    kernel_of("conv", f"channel_partial_{sfx}")(
        partial,
        x,
        np.int64(outer),
        np.int64(c),
        np.int64(inner),
        np.int64(splits),
        block=(256, 1, 1),
        grid=(min(c * splits, 1 << 20), 1),
        stream=stream,
    )
    launch(kernel_of("conv", f"channel_finish_{sfx}"), c, out, partial, np.int64(c), np.int64(splits), stream=stream)
    return out


def add_channel_bias(y, b) -> None:
    """y += b broadcast along axis 1, in place."""
    if y.size == 0:
        return
    inner = math.prod(int(d) for d in y.shape[2:])
    kernel = kernel_of("conv", f"add_channel_bias_{require_suffix(y.dtype)}")
    launch(kernel, y.size, y, contiguous(b), np.int64(y.shape[1]), np.int64(inner), np.int64(y.size))


# ---------------------------------------------------------------------------------------------
# geometry


class _Geometry:
    """A Conv's resolved geometry: pads (begin/end), strides, dilations, shapes."""

    def __init__(self, x_shape, w_shape, attrs):
        from gradgen.ops.conv import conv_geometry

        group = int(attrs.get("group", 1) or 1)
        self.begin, self.end, self.strides, self.dilations, self.y_shape = conv_geometry(
            x_shape,
            w_shape,
            auto_pad=attrs.get("auto_pad", "NOTSET") or "NOTSET",
            dilations=attrs.get("dilations"),
            group=group,
            kernel_shape=attrs.get("kernel_shape"),
            pads=attrs.get("pads"),
            strides=attrs.get("strides"),
        )
        self.begin, self.end = [int(v) for v in self.begin], [int(v) for v in self.end]
        self.strides, self.dilations = [int(v) for v in self.strides], [int(v) for v in self.dilations]
        self.x_shape, self.w_shape, self.group = tuple(int(d) for d in x_shape), tuple(int(d) for d in w_shape), group
        self.y_shape = tuple(int(d) for d in self.y_shape)
        self.nd = len(self.x_shape) - 2
        self.symmetric = self.begin == self.end

    def lifted(self, shape):
        """``shape`` with a unit axis before the spatial axes of a 1-D convolution (cuDNN wants >= 2)."""
        return tuple(shape[:2]) + (1,) + tuple(shape[2:]) if self.nd == 1 else tuple(shape)

    def lift(self, values, fill):
        return [fill] + list(values) if self.nd == 1 else list(values)

    def padded_x_shape(self):
        return self.x_shape[:2] + tuple(s + b + e for s, b, e in zip(self.x_shape[2:], self.begin, self.end))

    def direct_geom(self):
        g = np.zeros((), dtype=CONV_GEOM)
        g["n"], g["c"] = self.x_shape[0], self.x_shape[1]
        g["m"], g["g"] = self.w_shape[0], self.group
        g["inp"] = left_pad(self.x_shape[2:], SPATIAL, 1)
        g["out"] = left_pad(self.y_shape[2:], SPATIAL, 1)
        g["k"] = left_pad(self.w_shape[2:], SPATIAL, 1)
        g["s"] = left_pad(self.strides, SPATIAL, 1)
        g["d"] = left_pad(self.dilations, SPATIAL, 1)
        g["pb"] = left_pad(self.begin, SPATIAL, 0)
        return g[()]


_GEOMETRIES: dict = {}


def _geometry(x_shape, w_shape, attrs) -> _Geometry:
    """_Geometry, cached per shapes and attributes (it is resolved on every call otherwise)."""

    def frozen(v):
        return tuple(int(i) for i in v) if isinstance(v, (list, tuple, np.ndarray)) else v

    key = (tuple(x_shape), tuple(w_shape), tuple((k, frozen(v)) for k, v in sorted(attrs.items())))
    geom = _GEOMETRIES.get(key)
    if geom is None:
        geom = _Geometry(x_shape, w_shape, attrs)
        if len(_GEOMETRIES) < 4096:
            _GEOMETRIES[key] = geom
    return geom


def _use_cudnn(geom, dtype) -> bool:
    return not FORCE_DIRECT and is_float(dtype) and 1 <= geom.nd <= 3


def _pad_x(x, geom, stream=None):
    """X copied into a zero-padded buffer (for asymmetric padding)."""
    return window_copy(x, geom.padded_x_shape(), shift=[0, 0] + [-b for b in geom.begin], stream=stream)


# ---------------------------------------------------------------------------------------------
# the three convolution passes (each: cuDNN, else the direct kernel). ``lane`` picks the stream
# (0: the default one); ``keep`` collects temporaries that must outlive a concurrent section.


def _pass_output(shape, dtype, *operands):
    """A pass's output buffer, and whether it is already final: when it is empty, or when an
    operand is empty (a sum of nothing: zeros)."""
    from gradgen.cuda import runtime as rt

    out = rt.empty(shape, dtype)
    if out.size == 0:
        return out, True
    if any(t.size == 0 for t in operands):
        rt.memset_zero(out)
        return out, True
    return out, False


def _pass_plan(kind, dtype, geom, a_shape, b_shape, out_shape, pads, ptrs, lane=0, out_dtype=None):
    """``_plan`` for a pass of this geometry: shapes and pads lifted to cuDNN's rank."""
    return _plan(
        kind,
        dtype,
        geom.lifted(a_shape),
        geom.lifted(b_shape),
        geom.lifted(out_shape),
        geom.lift(pads, 0),
        geom.lift(geom.strides, 1),
        geom.lift(geom.dilations, 1),
        ptrs,
        lane,
        out_dtype,
    )


def _fprop(x, w, geom, out_dtype=None):
    """Y of the convolution, of ``out_dtype`` (default: X's type). A wider ``out_dtype`` where cuDNN
    has no engine for it: the convolution of X and W cast up to it (exact products, the same sums:
    the values the CPU backend computes, more slowly)."""
    out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    y, final = _pass_output(geom.y_shape, out_dtype, x, w)
    if final:
        return y
    if _use_cudnn(geom, x.dtype):
        xs, pads = (x, geom.begin) if geom.symmetric else (_pad_x(x, geom), [0] * geom.nd)
        ptrs = (y.gpudata, xs.gpudata, w.gpudata)
        plan = _pass_plan("fprop", x.dtype, geom, xs.shape, geom.w_shape, geom.y_shape, pads, ptrs, out_dtype=out_dtype)
        if plan is not None:
            plan.run(y.gpudata, xs.gpudata, w.gpudata)
            return y
    if out_dtype != x.dtype:
        return _fprop(cast_to(x, out_dtype), cast_to(w, out_dtype), geom)
    if geom.nd > 3:
        raise KernelError(f"Conv on the GPU supports 1 to 3 spatial axes, got {geom.nd}")
    kernel = kernel_of("conv", f"conv_fwd_{require_suffix(x.dtype)}")
    launch(kernel, y.size, y, x, w, geom.direct_geom(), np.int64(y.size))
    return y


def _dgrad(dy, w, geom, lane=0, keep=None):
    from gradgen.cuda import runtime as rt

    stream = _lane(lane)[0] if lane else None
    dx, final = _pass_output(geom.x_shape, dy.dtype, dy, w)
    if final:
        return dx
    if _use_cudnn(geom, dy.dtype):
        if geom.symmetric:
            target, pads = dx, geom.begin
        else:
            target, pads = rt.empty(geom.padded_x_shape(), dy.dtype), [0] * geom.nd
        ptrs = (target.gpudata, dy.gpudata, w.gpudata)
        plan = _pass_plan("dgrad", dy.dtype, geom, geom.y_shape, geom.w_shape, target.shape, pads, ptrs, lane)
        if plan is not None:
            plan.run(target.gpudata, dy.gpudata, w.gpudata, keep)
            if target is dx:
                return dx
            if keep is not None:
                keep.append(target)
            return window_copy(target, geom.x_shape, shift=[0, 0] + list(geom.begin), stream=stream)
    kernel = kernel_of("conv", f"conv_dgrad_{require_suffix(dy.dtype)}")
    launch(kernel, dx.size, dx, dy, w, geom.direct_geom(), np.int64(dx.size), stream=stream)
    return dx


def _wgrad(dy, x, geom, lane=0, keep=None):
    stream = _lane(lane)[0] if lane else None
    dw, final = _pass_output(geom.w_shape, dy.dtype, dy, x)
    if final:
        return dw
    if _use_cudnn(geom, dy.dtype):
        xs, pads = (x, geom.begin) if geom.symmetric else (_pad_x(x, geom, stream), [0] * geom.nd)
        if keep is not None and xs is not x:
            keep.append(xs)
        ptrs = (dw.gpudata, xs.gpudata, dy.gpudata)
        plan = _pass_plan("wgrad", dy.dtype, geom, xs.shape, geom.y_shape, geom.w_shape, pads, ptrs, lane)
        if plan is not None:
            plan.run(dw.gpudata, xs.gpudata, dy.gpudata, keep)
            return dw
    kernel = kernel_of("conv", f"conv_wgrad_{require_suffix(dy.dtype)}")
    kernel(dw, x, dy, geom.direct_geom(), np.int64(dw.size), block=(256, 1, 1), grid=(min(dw.size, 1 << 20), 1), stream=stream)
    return dw


def _check_ranks(x, w):
    if x.ndim < 3 or w.ndim != x.ndim:
        raise KernelError(f"Conv needs X of rank >= 3 and W of the same rank; got X {list(x.shape)}, W {list(w.shape)}")


# ---------------------------------------------------------------------------------------------
# launchers


@cuda_kernel("Conv")
def conv(x, w, b=None, **attrs):
    """``attrs``: the node's attributes, read with their ONNX defaults by gradgen.ops.conv (see _Geometry)."""
    _check_ranks(x, w)
    if x.dtype != w.dtype or (b is not None and b.dtype != x.dtype):
        raise KernelError(
            f"X, W (and B) must have one dtype; got {x.dtype}, {w.dtype}" + (f", {b.dtype}" if b is not None else "")
        )
    geom = _geometry(x.shape, w.shape, attrs)
    if b is not None and tuple(b.shape) != (geom.w_shape[0],):
        raise KernelError(f"B has shape {list(b.shape)}, expected [{geom.w_shape[0]}] (one bias per filter)")
    if not is_float(x.dtype) or geom.nd > 3:
        return cpu_fallback("Conv", x, w, b, **attrs)
    y = _fprop(contiguous(x), contiguous(w), geom)
    if b is not None:
        add_channel_bias(y, b)
    return y


def conv_float32_output(x, w, b=None, **attrs):
    """Conv of 16-bit X and W (and B) into a float32 Y: cuDNN's float32 accumulator stored without
    the 16-bit rounding, for the executor's Conv + Cast-to-float32 pair
    (gradgen/executor/excess_precision.py). Other dtypes: Conv, then the cast."""
    _check_ranks(x, w)
    narrow = dtype_suffix(x.dtype) in ("bf16", "f16")
    if x.dtype != w.dtype or (b is not None and b.dtype != x.dtype) or not narrow:
        y = conv(x, w, b, **attrs)  # its checks and its fallbacks, then the cast
        return cast_to(y, np.float32) if hasattr(y, "gpudata") else np.asarray(y).astype(np.float32)
    geom = _geometry(x.shape, w.shape, attrs)
    if geom.nd > 3:  # the float32 Conv of the operands cast up (the CPU kernel's), as the CPU backend runs the step
        return conv(*(None if t is None else cast_to(t, np.float32) for t in (x, w, b)), **attrs)
    if b is not None and tuple(b.shape) != (geom.w_shape[0],):
        raise KernelError(f"B has shape {list(b.shape)}, expected [{geom.w_shape[0]}] (one bias per filter)")
    y = _fprop(contiguous(x), contiguous(w), geom, out_dtype=np.float32)
    if b is not None:
        add_channel_bias(y, cast_to(b, np.float32))
    return y


@cuda_kernel("QLinearConv")
def qlinear_conv(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, b=None, **attrs):
    """The CPU kernel's steps on the device: a float64 Conv of (x - x_zero_point) and
    (w - w_zero_point) plus the bias (exact for 8-bit operands), requantized
    (gradgen/kernels/cuda/quantize.py)."""
    from gradgen.kernels.cpu import conv as cpu
    from gradgen.kernels.cpu.quantize import check_linear_quantized, requantized_type
    from gradgen.kernels.cuda.elementwise import cast_to
    from gradgen.kernels.cuda.quantize import requantize, scale_ratio, wide_operand
    from gradgen.kernels.cuda.shape import reshaped

    check_linear_quantized("QLinearConv", x, x_zero_point, w, w_zero_point, y_zero_point, (x_scale, w_scale, y_scale))
    cpu.check_qlinear_conv_scalars(dict(x_scale=x_scale, x_zero_point=x_zero_point, y_scale=y_scale, y_zero_point=y_zero_point))
    _check_ranks(x, w)
    rank, channels = len(x.shape), w.shape[0]
    per_channel = {
        name: cpu.qlinear_conv_channel_shape(tuple(v.shape), rank, channels, name)
        for name, v in (("w_scale", w_scale), ("w_zero_point", w_zero_point))
        if v is not None
    }
    if b is not None and (np.dtype(b.dtype) != np.int32 or tuple(b.shape) != (channels,)):
        raise KernelError(f"QLinearConv's B must be int32 of shape [{channels}], got {b.dtype}{list(b.shape)}")
    w_zp_shape = (channels,) + (1,) * (rank - 1) if per_channel.get("w_zero_point") else ()
    accumulated = conv(
        wide_operand(x, x_zero_point, ()),
        wide_operand(w, w_zero_point, w_zp_shape),
        None if b is None else cast_to(b, np.float64),
        **attrs,
    )
    ratio = scale_ratio(x_scale, w_scale, y_scale, ((), per_channel["w_scale"], ()))
    y_zp = None if y_zero_point is None else reshaped(y_zero_point, ())
    return requantize(accumulated, ratio, y_zp, requantized_type(y_zero_point, x.dtype))


@cuda_kernel("ConvTranspose")
def conv_transpose(x, w, b=None, **attrs):
    """ConvTranspose as the input gradient of the Conv it transposes (cuDNN's dgrad, else the direct
    kernel; ``gradgen.ops.conv.conv_transpose_as_conv``); the CPU kernel where that Conv would need
    negative padding, for non-float types and beyond 3 spatial axes."""
    from gradgen.ops.conv import conv_transpose_as_conv

    _check_ranks(x, w)
    if x.dtype != w.dtype or (b is not None and b.dtype != x.dtype):
        raise KernelError(
            f"X, W (and B) must have one dtype; got {x.dtype}, {w.dtype}" + (f", {b.dtype}" if b is not None else "")
        )
    mapped = conv_transpose_as_conv(x.shape, w.shape, attrs) if is_float(x.dtype) and x.ndim <= 5 else None
    if mapped is None:
        return cpu_fallback("ConvTranspose", x, w, b, **attrs)
    conv_x_shape, conv_attrs = mapped
    if b is not None and tuple(b.shape) != (conv_x_shape[1],):
        raise KernelError(f"B has shape {list(b.shape)}, expected [{conv_x_shape[1]}] (one bias per output channel)")
    y = _dgrad(contiguous(x), contiguous(w), _geometry(conv_x_shape, w.shape, conv_attrs))
    if b is not None:
        add_channel_bias(y, b)
    return y


@cuda_kernel("ConvGrad", domain=MICROSOFT)
def conv_grad(dY, X, W, *, _num_outputs=3, _wanted=None, **attrs):
    """(dX, dW, dB) of Conv(X, W[, B]) with Conv's attributes ``attrs``; only the first
    ``_num_outputs`` are returned, and outputs the node leaves unnamed (``_wanted`` False) are not
    computed."""
    wanted = _wanted or (True,) * _num_outputs
    if not dY.dtype == X.dtype == W.dtype:
        raise KernelError(f"dY, X and W must have one dtype; got {dY.dtype}, {X.dtype}, {W.dtype}")
    geom = _geometry(X.shape, W.shape, attrs)
    if tuple(dY.shape) != geom.y_shape:
        raise KernelError(f"dY has shape {list(dY.shape)}, but Conv's output shape is {list(geom.y_shape)}")
    if not is_float(X.dtype) or geom.nd > 3:
        return cpu_fallback("ConvGrad", dY, X, W, domain=MICROSOFT, _num_outputs=_num_outputs, **attrs)
    dY, X, W = contiguous(dY), contiguous(X), contiguous(W)
    if CONCURRENT and _num_outputs >= 2 and all(wanted) and min(dY.size, X.size, W.size) > 0:
        # dX on side stream 1 while dW and dB run on side stream 2. Both are blocking streams: they
        # start after the default stream's earlier work, and the barrier below (a default-stream
        # launch) waits for both; temporaries stay referenced until then.
        keep: list = []
        dw = _wgrad(dY, X, geom, lane=2, keep=keep)
        db = channel_sum(dY, stream=_lane(2)[0], keep=keep) if _num_outputs >= 3 else None
        dx = _dgrad(dY, W, geom, lane=1, keep=keep)
        barrier()
        del keep
        return (dx, dw) if db is None else (dx, dw, db)
    computes = (lambda: _dgrad(dY, W, geom), lambda: _wgrad(dY, X, geom), lambda: channel_sum(dY))
    return tuple(compute() if wanted[i] else None for i, compute in enumerate(computes[:_num_outputs]))


# ---------------------------------------------------------------------------------------------
# Col2Im

_ONE_HOT_KERNELS: dict = {}


def _one_hot_kernels(block: tuple, dtype):
    """ConvTranspose weights (taps, 1, *block) on the device, kernel t one-hot at block position t
    (row-major): uploaded once per (block, dtype), released at exit while the context is current."""
    rt = runtime()

    def upload():
        if not _ONE_HOT_KERNELS:
            rt.drop_at_exit(_ONE_HOT_KERNELS.clear)
        taps = math.prod(block)
        with rt.persistent():
            return rt.to_device(np.eye(taps, dtype=dtype).reshape(taps, 1, *block))

    return plan_cache(_ONE_HOT_KERNELS, (block, np.dtype(dtype).str), upload)


@cuda_kernel("Col2Im", host_inputs=(1, 2))
def col2im(x, image_shape, block_shape, *, dilations=None, pads=None, strides=None):
    """The columns of X (N, C * taps, L) summed into the image (N, C, *image_shape): X viewed as
    (N * C, taps, *blocks per axis) and transposed through a Conv whose taps one-hot kernels cut
    the blocks out of (N * C, 1, *image) (ConvTranspose, with the pads, strides and dilations, and
    as output padding the rows the blocks do not reach at the image's end). float32 and float64 in
    their own type, 16-bit X in float32 rounded once (as on the CPU); other dtypes and more than 3
    spatial axes run the CPU kernel."""
    rt = runtime()
    attrs = dict(dilations=dilations, pads=pads, strides=strides)
    image, block, dil, pad, st, counts = col2im_geometry(
        np.asarray(image_shape).reshape(-1), np.asarray(block_shape).reshape(-1), **attrs
    )
    nd = len(image)
    n, c = int(x.shape[0]), col2im_channels(tuple(x.shape), image, block, counts)
    if not is_float(x.dtype) or nd > SPATIAL:
        return cpu_fallback("Col2Im", x, image_shape, block_shape, **attrs)
    out_shape = (n, c, *image)
    if math.prod(out_shape) == 0:  # nothing to sum into (PyCUDA cannot reshape an empty array's null pointer)
        return rt.zeros(out_shape, x.dtype)
    # rows past the last block's reach at the image's end (the floor of the blocks per axis)
    uncovered = [(image[i] + pad[i] + pad[nd + i] - (block[i] - 1) * dil[i] - 1) % st[i] for i in range(nd)]

    def run(xc):
        planes = contiguous(xc).reshape((n * c, math.prod(block), *counts))
        kernels = _one_hot_kernels(tuple(block), xc.dtype)
        y = conv_transpose(planes, kernels, dilations=dil, pads=pad, strides=st, output_padding=uncovered)
        return y.reshape(out_shape)

    return in_float32(run, x)
