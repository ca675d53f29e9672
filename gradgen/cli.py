"""The ``gradgen`` command line. Thin: parses, calls the Python API, prints.

Exit codes: 0 success, 2 usage error, 3 model error, 4 run-time error, 1 anything unexpected.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from gradgen.errors import GradgenError

app = typer.Typer(
    name="gradgen",
    help="Build backward (gradient) graphs of ONNX models and run them on the CPU or a CUDA GPU.\n\n"
    "Typical use: gradgen build-backward model.onnx -o model_grad.onnx, then "
    "gradgen run model_grad.onnx --inputs sample.npz -o grads.npz.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_state = {"debug": False, "progress": False}
_notes_said: set[str] = set()  # one-time notes are said once per process


def _say(message: str) -> None:
    typer.echo(message, err=True)


def _progress(message: str) -> None:
    """A progress line on stderr: only on a terminal, or with --progress."""
    if _state["progress"]:
        _say(message)


def _note(message: str) -> None:
    """A note on stderr (e.g. the CPU fallback), said once per process."""
    if message not in _notes_said:
        _notes_said.add(message)
        _say(f"note: {message}")


def _warnings_as_notes():
    """Say the warnings raised inside as one-time notes, before any error that follows them."""
    from gradgen.errors import warnings_said

    return warnings_said(_note)


def _set_progress(flag: Optional[bool]) -> None:
    _state["progress"] = sys.stderr.isatty() if flag is None else flag


def progress_printer(flag: Optional[bool]) -> Optional[Callable[[str], None]]:
    """A command's ``--progress/--no-progress`` (None: only on a terminal) applied: the function
    that says a progress line on stderr, or None where progress is off."""
    _set_progress(flag)
    return _progress if _state["progress"] else None


def _finite_non_negative(value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise typer.BadParameter(f"{value} is not a finite number >= 0")
    return value


def _finite_non_negative_or_none(value: Optional[float]) -> Optional[float]:
    return None if value is None else _finite_non_negative(value)


_FLOOR_DEFAULT = 0.1


def _require_compare(compare: Optional[Path], **given) -> None:
    """Options of --compare are a usage error without it (they would be ignored)."""
    from gradgen.errors import UsageError

    named = [name.replace("_", "-") for name, value in given.items() if value not in (None, False)]
    if compare is None and named:
        raise UsageError(f"--{named[0]} only applies with --compare REF.npz; pass --compare or drop --{named[0]}")


def _dims(pairs: Optional[List[str]], random_inputs: bool) -> dict[str, int]:
    """--dim NAME=VALUE pairs; they only mean something with --random-inputs."""
    from gradgen.errors import UsageError
    from gradgen.inputs import parse_dims

    dims = parse_dims(pairs or [])
    if dims and not random_inputs:
        raise UsageError("--dim sets symbolic dimensions for --random-inputs; pass --random-inputs or drop --dim")
    return dims


def _version(value: bool) -> None:
    if value:
        from gradgen import __version__

        typer.echo(f"gradgen {__version__}")
        raise typer.Exit()


_PROGRESS = typer.Option(
    None, "--progress/--no-progress", help="Say what is being done on stderr. Default: only when stderr is a terminal."
)
_RANDOM_INPUTS = typer.Option(
    False,
    "--random-inputs",
    help="Draw the inputs --inputs does not give from their declared types and shapes (a symbolic size from "
    "--dim, else from a given array that has it); a note names the drawn ones.",
)
_SEED = typer.Option(0, "--seed", min=0, help="Seed for --random-inputs.")
_THREADS = typer.Option(
    None,
    "--threads",
    min=1,
    help="CPU: threads of the matrix products (oneDNN's OpenMP pool for the large ones where it is installed, "
    "numpy's BLAS for the rest; the CPU executor starts no threads of its own). Default: all available cores "
    "unless OMP_NUM_THREADS and co. say otherwise.",
)
_DIM = typer.Option(
    None, "--dim", help="NAME=VALUE for a symbolic dimension of the model's inputs, with --random-inputs (repeatable)."
)


@app.callback()
def _main(
    debug: bool = typer.Option(False, "--debug", help="Show a full traceback on errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    _state["debug"] = debug


@app.command("build-backward")
def build_backward(
    model: Path = typer.Argument(..., help="Forward ONNX model whose graph computes the loss."),
    out: Path = typer.Option(..., "-o", "--output", help="Where to write the forward+backward model (never MODEL)."),
    loss: Optional[str] = typer.Option(
        None,
        "--loss",
        help="Graph output to differentiate. Default: the only scalar float output. "
        "A non-scalar output gives a vector-Jacobian product: OUT gets a graph input <loss>_grad.",
    ),
    wrt: Optional[List[str]] = typer.Option(
        None,
        "--wrt",
        help="Differentiate with respect to this tensor (repeatable). Default: every float initializer the loss depends on.",
    ),
    freeze: Optional[List[str]] = typer.Option(None, "--freeze", help="Exclude this tensor (repeatable)."),
    wrt_inputs: bool = typer.Option(False, "--wrt-inputs", help="Also differentiate with respect to every float graph input."),
    portable: bool = typer.Option(
        False,
        "--portable",
        help="Lower the com.microsoft gradient ops to standard ONNX ops, so that any ONNX "
        "runtime (e.g. stock onnxruntime) can run OUT.",
    ),
    add_loss: Optional[str] = typer.Option(
        None,
        "--add-loss",
        help="Append a loss (cross_entropy, mse, l1, bce_with_logits) to the output named by "
        "--loss-output and differentiate it; its target becomes a graph input (labels or target).",
    ),
    loss_output: Optional[str] = typer.Option(
        None, "--loss-output", help="With --add-loss: the output (logits, predictions) the loss reads."
    ),
    precision: str = typer.Option(
        "fp32",
        "--precision",
        help="fp32 (default), tf32 (fp32 graph; TF32 GEMMs requested of the GPU), bf16 or "
        "fp16: torch.autocast's mixed precision as Casts in the graph, parameters and gradients stay float32.",
    ),
    tie_weights: bool = typer.Option(
        False,
        "--tie-weights",
        help="Tie an initializer and its transposed copy (how PyTorch's exporters write a tied LM head) into "
        "one parameter, whose gradient sums both uses as PyTorch's does. Without it a note names such pairs.",
    ),
    progress: Optional[bool] = _PROGRESS,
) -> None:
    """Write MODEL plus its backward graph to OUT: one output <x>_grad per differentiated tensor x."""
    from gradgen.api import build_backward as build
    from gradgen.model_io import check_output_path, save_model
    from gradgen.passes.autocast import check_precision

    _set_progress(progress)
    check_precision(precision)
    check_output_path(out, model)
    started = time.perf_counter()
    _progress(f"building the backward graph of {model}" + (" (portable)" if portable else ""))
    with _warnings_as_notes():
        result = build(
            model,
            loss=loss,
            wrt=wrt,
            freeze=freeze or (),
            wrt_inputs=wrt_inputs,
            portable=portable,
            add_loss=_loss_spec(add_loss, loss_output),
            precision=precision,
            tie_weights=tie_weights,
        )
    _progress(f"writing {out}")
    save_model(result.model, out)
    seconds = time.perf_counter() - started
    nodes = sum(1 for _ in result.model.graph)
    typer.echo(f"loss: {result.loss}")
    typer.echo(f"gradients ({len(result.wrt)}): {', '.join(result.gradient_names)}")
    typer.echo(f"wrote {out} ({nodes} nodes) in {seconds:.2f} s")


def _loss_spec(kind: Optional[str], output: Optional[str]):
    """build-backward's --add-loss / --loss-output as a LossSpec (None without --add-loss)."""
    from gradgen.errors import UsageError

    if kind is None:
        if output is not None:
            raise UsageError("--loss-output goes with --add-loss")
        return None
    if output is None:
        raise UsageError("--add-loss needs --loss-output NAME: the output (logits, predictions) the loss reads")
    from gradgen.training.cli import loss_kind
    from gradgen.training.losses import LossSpec

    return LossSpec(loss_kind(kind), output, output_option="--loss-output")


@app.command("run")
def run(
    model: Path = typer.Argument(..., help="ONNX model to run (a forward model or one built by build-backward)."),
    inputs: Optional[Path] = typer.Option(None, "--inputs", help=".npz file with one array per graph input."),
    random_inputs: bool = _RANDOM_INPUTS,
    seed: int = _SEED,
    dim: Optional[List[str]] = _DIM,
    device: str = typer.Option("auto", "--device", help="auto (CUDA if a GPU answers, else CPU), cpu or cuda."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Save every graph output to this .npz."),
    compare: Optional[Path] = typer.Option(
        None,
        "--compare",
        help="Reference .npz (e.g. PyTorch's gradients): compare the outputs its keys name; "
        "exit 4 if any differs beyond the tolerance or if a key names no output.",
    ),
    rtol: Optional[float] = typer.Option(
        None,
        "--rtol",
        callback=_finite_non_negative_or_none,
        show_default=False,
        help="--compare: tolerance relative to each reference element. Default per the model's precision: "
        "1e-4 (fp32, tf32), 1e-3 (fp16), 1e-2 (bf16).",
    ),
    atol: Optional[float] = typer.Option(
        None,
        "--atol",
        callback=_finite_non_negative_or_none,
        show_default=False,
        help="--compare: tolerance as a fraction of the tensor's scale (max(max|ref|, max|got|, floor * largest "
        "|gradient| of the model)). Default per the model's precision: 1e-5 (fp32, tf32), 1e-2 (fp16), 5e-2 (bf16).",
    ),
    floor: float = typer.Option(
        _FLOOR_DEFAULT,
        "--floor",
        callback=_finite_non_negative,
        help="--compare: a tensor's scale is at least this fraction of the largest |value| "
        "among the compared gradients, so that a gradient that is zero up to float "
        "rounding passes.",
    ),
    torch_names: bool = typer.Option(
        False,
        "--torch-names",
        help="--compare: a reference key w that names no output is compared with the "
        "output w_grad (gradients saved under PyTorch's parameter names).",
    ),
    skip_unmatched: bool = typer.Option(
        False, "--skip-unmatched", help="--compare: reference keys that name no output are listed but not an error."
    ),
    threads: Optional[int] = _THREADS,
    progress: Optional[bool] = _PROGRESS,
    profile: bool = typer.Option(
        False,
        "--profile",
        help="CPU: time every step over 3 more runs and print the time by op type and the slowest steps.",
    ),
) -> None:
    """Run MODEL on gradgen's executor and print a table of its outputs."""

    from gradgen.errors import UsageError
    from gradgen.executor import Session
    from gradgen.executor.threads import check_threads, cpu_threads
    from gradgen.inputs import load_npz, random_feeds, save_npz, tell_drawn
    from gradgen.model_io import check_output_path

    _set_progress(progress)
    check_threads(threads)
    _require_compare(
        compare, rtol=rtol, atol=atol, floor=floor != _FLOOR_DEFAULT, torch_names=torch_names, skip_unmatched=skip_unmatched
    )
    if out is not None:
        check_output_path(out, model, *(p for p in (inputs, compare) if p is not None))
    dims = _dims(dim, random_inputs)
    reference = load_npz(compare) if compare is not None else None
    feeds = load_npz(inputs) if inputs is not None else {}  # a bad file is said before the model loads
    _progress(f"loading {model}")
    with _warnings_as_notes():
        session = Session(model, device=device)
    if random_inputs:
        with _warnings_as_notes():
            drawn = random_feeds(session.model, seed=seed, dims=dims, given=feeds)
            if inputs is not None:
                tell_drawn(drawn, str(inputs))
        feeds = {**drawn, **feeds}
    if inputs is None and not random_inputs and session.input_names:
        raise UsageError(f"the model has inputs ({', '.join(session.input_names)}); pass --inputs FILE.npz or --random-inputs")
    if profile:
        from gradgen.executor.profile import require_cpu

        require_cpu(session)
    _progress(f"running on {session.device}")
    started = time.perf_counter()
    with _warnings_as_notes(), cpu_threads(threads):
        results = session.run(feeds)
    seconds = time.perf_counter() - started
    typer.echo(_format_table(results))
    typer.echo(f"ran on {session.device} in {seconds:.3f} s")
    memory = session.memory_stats()
    if memory:
        typer.echo(
            f"device memory: planned arena {_format_bytes(memory['planned_bytes'])} (live-set lower bound "
            f"{_format_bytes(memory['peak_live_bytes'])}), peak held by the run "
            f"{_format_bytes(memory['peak_held_bytes'])}"
        )
    if out is not None:
        _progress(f"writing {out}")
        save_npz(out, results)
        typer.echo(f"wrote {len(results)} output(s) to {out}")
    if profile:
        from gradgen.executor.profile import format_profile, profile_run

        _progress("profiling")
        with _warnings_as_notes(), cpu_threads(threads):
            typer.echo(format_profile(profile_run(session, feeds)))
    if reference is not None:
        _compare(
            session,
            feeds,
            results,
            reference,
            rtol=rtol,
            atol=atol,
            floor=floor,
            torch_names=torch_names,
            skip_unmatched=skip_unmatched,
        )


def _compare(
    session,
    feeds,
    results,
    reference,
    *,
    rtol: Optional[float],
    atol: Optional[float],
    floor: float,
    torch_names: bool,
    skip_unmatched: bool,
) -> None:
    """Print the comparison with the reference; raise RunError on a mismatch or an unmatched key.

    A tolerance not given (None) is the default for the model's precision (``compare.resolve_tolerance``)."""
    from gradgen.compare import compare_outputs, diagnose_kinks, require_match, resolve_tolerance
    from gradgen.errors import RunError

    tolerance = resolve_tolerance(session.model, rtol, atol)
    comparison = compare_outputs(
        results,
        reference,
        rtol=tolerance.rtol,
        atol=tolerance.atol,
        floor=floor,
        torch_names=torch_names,
        defaults=tolerance.source,
    )
    if not comparison.rows:
        hint = f"; {comparison.hint}" if comparison.hint else ""
        raise RunError(
            f"the reference's keys ({', '.join(comparison.unmatched) or 'none'}) name none of the model's "
            f"outputs ({', '.join(results)}){hint}"
        )
    typer.echo("")
    typer.echo(comparison.format())
    if comparison.unmatched:
        typer.echo(f"not compared (no output of that name): {', '.join(comparison.unmatched)}")
    if comparison.failures:
        _progress("looking for kinks decided by float rounding (a float64 run of the graph)")
        for note in diagnose_kinks(session.model, feeds, comparison, reference, device=session.device):
            _say(f"note: {note}")
    require_match(comparison, skip_unmatched)
    skipped = f"; {len(comparison.unmatched)} reference key(s) not compared" if comparison.unmatched else ""
    typer.echo(f"all {len(comparison.rows)} compared output(s) match the reference ({comparison.tolerance}){skipped}")


def _format_bytes(count: int) -> str:
    """``32.0 KiB``, ``5.1 MiB``, ``1.20 GiB``: a size in the unit that shows it."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{count} B"


def _format_table(results) -> str:
    header = ("output", "shape", "dtype", "min", "max", "mean", "L2 norm")
    rows = []
    for name, value in results.items():
        stats = _stats(value)
        shown = [f"{x:.6g}" for x in stats] if stats else ["-"] * 4
        rows.append((name, str(list(value.shape)), str(value.dtype), *shown))
    from gradgen.text_table import format_table

    return format_table(header, rows)


def _stats(value, chunk: int = 1 << 20) -> Optional[tuple[float, float, float, float]]:
    """min, max, mean and L2 norm in float64, a chunk at a time (no float64 copy of a large output)."""
    import numpy as np

    if not value.size or value.dtype.kind not in "fiub":
        return None
    flat = value.reshape(-1)
    low, high, total, squares = math.inf, -math.inf, 0.0, 0.0
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk].astype(np.float64)
        low, high = min(low, float(part.min())), max(high, float(part.max()))
        total += float(part.sum())
        squares += float(np.dot(part, part))
    return low, high, total / flat.size, math.sqrt(squares)


@app.command("ops")
def ops(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of objects."),
    signatures: bool = typer.Option(
        False, "--signatures", help="Print the signatures of the com.microsoft ops gradgen emits instead."
    ),
) -> None:
    """List every op gradgen knows: gradient rule, CPU kernel, CUDA kernel."""
    from gradgen.support import microsoft_signatures, supported_ops

    if signatures:
        for text in microsoft_signatures():
            typer.echo(text)
        return
    table = supported_ops()
    if as_json:
        typer.echo(json.dumps(table, indent=1))
        return
    header = ("domain", "op_type", "gradient", "cpu", "cuda")
    rows = [(r["domain"] or "ai.onnx", r["op_type"], r["gradient"], _cpu_column(r), _cuda_column(r)) for r in table]
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    typer.echo(f"{len(rows)} ops")
    if any(r["gradient"] == "rewritten" for r in table):
        typer.echo("rewritten: build-backward turns the op into others before the gradient pass (--json: rewritten_to)")
    if any(r["cuda_form"] or r["session_form"] for r in table):
        typer.echo(
            "form: a session runs the op as other ops: on the GPU the standard ops build-backward writes for it "
            "(--json: cuda_form), a sequence or optional op as the tensors it holds (--json: session_form)"
        )


def _cpu_column(row: dict) -> str:
    return "yes" if row["cpu"] else "form" if row["session_form"] else "no"


def _cuda_column(row: dict) -> str:
    return "yes" if row["cuda"] else "form" if row["cuda_form"] or row["session_form"] else "no"


@app.command("check")
def check(
    model: Path = typer.Argument(..., help="Forward ONNX model whose graph computes the loss."),
    loss: Optional[str] = typer.Option(None, "--loss", help="Graph output to differentiate (as in build-backward)."),
    wrt: Optional[List[str]] = typer.Option(None, "--wrt", help="Check the gradient of this tensor (repeatable)."),
    freeze: Optional[List[str]] = typer.Option(None, "--freeze", help="Exclude this tensor (repeatable)."),
    wrt_inputs: bool = typer.Option(False, "--wrt-inputs", help="Also check every float graph input."),
    inputs: Optional[Path] = typer.Option(None, "--inputs", help=".npz file with one array per graph input."),
    random_inputs: bool = _RANDOM_INPUTS,
    seed: int = typer.Option(0, "--seed", min=0, help="Seed for --random-inputs and the random directions."),
    dim: Optional[List[str]] = _DIM,
    samples: int = typer.Option(3, "--samples", min=1, help="Random directions per tensor."),
    rtol: float = typer.Option(
        1e-5, "--rtol", callback=_finite_non_negative, help="Tolerance relative to the size of the compared gradient."
    ),
    atol: float = typer.Option(1e-7, "--atol", callback=_finite_non_negative, help="Absolute tolerance."),
    device: str = typer.Option("cpu", "--device", help="auto, cpu or cuda."),
    progress: Optional[bool] = _PROGRESS,
) -> None:
    """Compare the backward graph with float64 finite differences of MODEL; exit 4 on a mismatch."""
    from gradgen.check import check_gradients
    from gradgen.errors import RunError

    _set_progress(progress)
    dims = _dims(dim, random_inputs)
    started = time.perf_counter()
    _progress(f"checking the gradients of {model} against float64 finite differences")
    with _warnings_as_notes():
        report = check_gradients(
            model,
            loss=loss,
            wrt=wrt,
            freeze=freeze or (),
            wrt_inputs=wrt_inputs,
            inputs=inputs,
            random_inputs=random_inputs,
            seed=seed,
            dims=dims,
            samples=samples,
            rtol=rtol,
            atol=atol,
            device=device,
        )
    typer.echo(f"loss: {report.loss} (float64, central differences, eps={report.eps:g})")
    typer.echo(report.format())
    seconds = time.perf_counter() - started
    if not report.passed:
        kinked = [t.name for t in report.tensors if not t.passed and t.kink]
        why = (
            f"; {', '.join(kinked)} at a kink of the loss (not differentiable at these inputs, so the finite "
            "differences may be the cause: try another --seed or other inputs)"
            if kinked
            else ""
        )
        raise RunError(
            f"gradient check failed for {len(report.failures)} of {len(report.tensors)} tensor(s): "
            f"{', '.join(report.failures)}{why}"
        )
    typer.echo(f"all {len(report.tensors)} gradient(s) match finite differences ({seconds:.2f} s)")


@app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def bench(ctx: typer.Context) -> None:
    """Time gradgen against PyTorch and ONNX Runtime: GPU kernels, real-size training steps (--only e2e),
    the CPU path (--only cpu). 'gradgen bench --help' lists the groups and options."""
    from gradgen.bench import run as bench_run

    argv = list(ctx.args)  # the options are gradgen.bench's own (one home for them)
    if _state["debug"] and "--debug" not in argv:
        argv.append("--debug")
    bench_run(argv)


from gradgen.training import cli as _training_cli  # noqa: E402  (imports typer only; the rest on use)

app.command("train")(_training_cli.train)
app.command("export")(_training_cli.export)
app.command("artifacts")(_training_cli.artifacts)


def _click_exception_type() -> type[Any]:
    """Click's ClickException class, whichever click typer uses.

    typer up to 0.2x re-exported the standalone ``click`` package; newer typer vendors its own copy
    (``typer._click``) and no longer installs click. ``typer.BadParameter`` exists in both, and
    ClickException is among its bases, so it is found without importing click by name.
    """
    for cls in typer.BadParameter.__mro__:
        if cls.__name__ == "ClickException":
            return cls
    return typer.BadParameter  # pragma: no cover - every known typer has it


def _usage_error_line(exc: Exception) -> str:
    """Click's own one-line message for a usage error, plus where to find help."""
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return f"error: {message}{hint}"


def _hoist_debug(args: list[str]) -> list[str]:
    """``--debug`` is accepted anywhere; click only knows it before the command name."""
    if "--debug" in args[1:]:
        return ["--debug", *(a for a in args if a != "--debug")]
    return args


class _Terminated(BaseException):
    """Raised by the CLI's SIGTERM / SIGHUP handler, so that cleanups (temporary files) run as for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame) -> None:
    for sig in _TERMINATING_SIGNALS:  # a second signal must not interrupt the cleanup of the first
        signal.signal(sig, signal.SIG_IGN)
    raise _Terminated(signum)


_TERMINATING_SIGNALS = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s]


@contextlib.contextmanager
def _terminating_signals_raise():
    """Turn SIGTERM and SIGHUP into an exception for the duration of a command (main thread only).

    A signal that is ignored (``nohup`` ignores SIGHUP) stays ignored.
    """
    previous = {}
    for sig in _TERMINATING_SIGNALS:
        try:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, _raise_terminated)
        except (ValueError, OSError):  # not the main thread: leave the signals alone
            break
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point: every error becomes one line on stderr and a documented exit code."""
    _state["debug"] = False
    args = _hoist_debug(list(sys.argv[1:] if argv is None else argv))
    with _terminating_signals_raise():
        _main_with_exit_codes(args)


def _main_with_exit_codes(args: list[str]) -> None:
    click_exception = _click_exception_type()
    try:
        code = app(args=args, prog_name="gradgen", standalone_mode=False)
    except _Terminated as exc:
        _say(f"error: terminated ({signal.Signals(exc.signum).name})")
        sys.exit(128 + exc.signum)
    except GradgenError as exc:
        if _state["debug"]:
            import traceback

            traceback.print_exc()
        _say(f"error: {exc}")
        sys.exit(exc.exit_code)
    except (typer.Exit, SystemExit) as exc:
        sys.exit(getattr(exc, "exit_code", getattr(exc, "code", 0)))
    except (typer.Abort, KeyboardInterrupt):
        _say("error: interrupted")
        sys.exit(130)
    except click_exception as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `gradgen`: the help, as no_args_is_help asks
            typer.echo(exc.ctx.get_help())
            sys.exit(0)
        _say(_usage_error_line(exc))
        sys.exit(getattr(exc, "exit_code", 2) or 2)
    except Exception as exc:  # anything unexpected: a bug
        if _state["debug"]:
            raise
        _say(f"internal error: {type(exc).__name__}: {exc} (run with --debug for a traceback; please report it)")
        sys.exit(1)
    if code == 130:  # typer turns Ctrl-C inside a command into Exit(130) and returns it
        _say("error: interrupted")
    sys.exit(code if isinstance(code, int) else 0)
