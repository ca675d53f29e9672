"""The ``gradgen`` command line. Thin: parses, calls the Python API, prints.

Exit codes: 0 success, 2 usage error, 3 model error, 4 run-time error, 1 anything unexpected.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional

import typer

from gradgen.errors import GradgenError

app = typer.Typer(
    name="gradgen",
    help="Build backward (gradient) graphs of ONNX models and run them on the CPU or a CUDA GPU.\n\n"
    "Typical use: gradgen build-backward model.onnx -o model_grad.onnx, then "
    "gradgen run model_grad.onnx --inputs sample.npz -o grads.npz.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_state = {"debug": False}


def _say(message: str) -> None:
    typer.echo(message, err=True)


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show a full traceback on errors.")) -> None:
    _state["debug"] = debug


@app.command("build-backward")
def build_backward(
    model: Path = typer.Argument(..., help="Forward ONNX model whose graph computes the loss."),
    out: Path = typer.Option(..., "-o", "--output", help="Where to write the forward+backward model (never MODEL)."),
    loss: Optional[str] = typer.Option(
        None, "--loss", help="Graph output to differentiate. Default: the only scalar float output. "
        "A non-scalar output gives a vector-Jacobian product: OUT gets a graph input <loss>_grad."),
    wrt: Optional[List[str]] = typer.Option(
        None, "--wrt", help="Differentiate with respect to this tensor (repeatable). "
        "Default: every float initializer the loss depends on."),
    freeze: Optional[List[str]] = typer.Option(None, "--freeze", help="Exclude this tensor (repeatable)."),
    wrt_inputs: bool = typer.Option(False, "--wrt-inputs", help="Also differentiate with respect to every float graph input."),
    portable: bool = typer.Option(
        False, "--portable", help="Lower the com.microsoft gradient ops to standard ONNX ops, so that any ONNX "
        "runtime (e.g. stock onnxruntime) can run OUT."),
) -> None:
    """Write MODEL plus its backward graph to OUT: one output <x>_grad per differentiated tensor x."""
    from gradgen.api import build_backward as build
    from gradgen.model_io import check_output_path, save_model

    check_output_path(out, model)
    started = time.perf_counter()
    _say(f"building the backward graph of {model}" + (" (portable)" if portable else ""))
    result = build(model, loss=loss, wrt=wrt, freeze=freeze or (), wrt_inputs=wrt_inputs, portable=portable)
    _say(f"writing {out}")
    save_model(result.model, out)
    seconds = time.perf_counter() - started
    nodes = sum(1 for _ in result.model.graph)
    typer.echo(f"loss: {result.loss}")
    typer.echo(f"gradients ({len(result.wrt)}): {', '.join(result.gradient_names)}")
    typer.echo(f"wrote {out} ({nodes} nodes) in {seconds:.2f} s")


@app.command("run")
def run(
    model: Path = typer.Argument(..., help="ONNX model to run (a forward model or one built by build-backward)."),
    inputs: Optional[Path] = typer.Option(None, "--inputs", help=".npz file with one array per graph input."),
    random_inputs: bool = typer.Option(False, "--random-inputs", help="Draw inputs from the declared types and shapes."),
    seed: int = typer.Option(0, "--seed", help="Seed for --random-inputs."),
    dim: Optional[List[str]] = typer.Option(None, "--dim", help="NAME=VALUE for a symbolic dimension (repeatable)."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA if a GPU answers, else CPU), cpu or cuda."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Save every graph output to this .npz."),
    compare: Optional[Path] = typer.Option(
        None, "--compare", help="Reference .npz (e.g. PyTorch's gradients): compare the outputs it names; "
        "exit 4 if any differs beyond the tolerance."),
    rtol: float = typer.Option(1e-4, "--rtol", help="Relative tolerance for --compare."),
    atol: float = typer.Option(1e-5, "--atol", help="Absolute tolerance for --compare, as a fraction of the reference's largest |value|."),
) -> None:
    """Run MODEL on gradgen's executor and print a table of its outputs."""

    from gradgen.executor import Session
    from gradgen.inputs import load_npz, parse_dims, random_feeds, save_npz
    from gradgen.model_io import check_output_path

    if out is not None:
        check_output_path(out, model, *(p for p in (inputs, compare) if p is not None))
    dims = parse_dims(dim or [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = Session(model, device=device)
    for warning in caught:
        _say(f"note: {warning.message}")
    feeds = {}
    if random_inputs:
        feeds.update(random_feeds(session.model, seed=seed, dims=dims))
    if inputs is not None:
        feeds.update(load_npz(inputs))
    if inputs is None and not random_inputs and session.input_names:
        from gradgen.errors import UsageError

        raise UsageError(f"the model has inputs ({', '.join(session.input_names)}); pass --inputs FILE.npz or --random-inputs")
    started = time.perf_counter()
    results = session.run(feeds)
    seconds = time.perf_counter() - started
    typer.echo(_format_table(results))
    typer.echo(f"ran on {session.device} in {seconds:.3f} s")
    if out is not None:
        save_npz(out, results)
        typer.echo(f"wrote {len(results)} output(s) to {out}")
    if compare is not None:
        _compare(results, load_npz(compare), rtol, atol)


def _compare(results, reference, rtol: float, atol: float) -> None:
    """Print max abs/rel error per output the reference names; raise RunError on any mismatch."""
    import numpy as np

    from gradgen.errors import RunError

    shared = [name for name in results if name in reference]
    if not shared:
        raise RunError("the reference file names none of the model's outputs")
    typer.echo("")
    header = ("compared", "max abs err", "max err / max|ref|", "verdict")
    rows, failed = [], []
    for name in shared:
        got, want = results[name].astype(np.float64), np.asarray(reference[name], dtype=np.float64)
        if got.shape != want.shape:
            rows.append((name, "-", "-", f"FAIL shape {list(got.shape)} vs {list(want.shape)}"))
            failed.append(name)
            continue
        diff = np.abs(got - want)
        scale = float(np.abs(want).max(initial=0.0))
        ok = bool(np.all(diff <= atol * scale + rtol * np.abs(want)))
        rel = float(diff.max(initial=0.0)) / scale if scale else float(diff.max(initial=0.0))
        rows.append((name, f"{diff.max(initial=0.0):.3g}", f"{rel:.3g}", "ok" if ok else "FAIL"))
        if not ok:
            failed.append(name)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if failed:
        raise RunError(f"{len(failed)} output(s) differ from the reference beyond rtol={rtol}, atol={atol}*max|ref|: {', '.join(failed)}")
    typer.echo(f"all {len(rows)} compared output(s) match the reference (rtol={rtol}, atol={atol}*max|ref|)")


def _format_table(results) -> str:
    import numpy as np

    header = ("output", "shape", "dtype", "min", "max", "mean", "L2 norm")
    rows = []
    for name, value in results.items():
        if value.size and value.dtype.kind in "fiub":
            data = value.astype(np.float64)
            stats = [f"{data.min():.6g}", f"{data.max():.6g}", f"{data.mean():.6g}", f"{np.sqrt((data * data).sum()):.6g}"]
        else:
            stats = ["-"] * 4
        rows.append((name, str(list(value.shape)), str(value.dtype), *stats))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@app.command("ops")
def ops(as_json: bool = typer.Option(False, "--json", help="Print a JSON list of objects.")) -> None:
    """List every op gradgen knows: gradient rule, CPU kernel, CUDA kernel."""
    from gradgen.support import supported_ops

    table = supported_ops()
    if as_json:
        typer.echo(json.dumps(table, indent=1))
        return
    header = ("domain", "op_type", "gradient", "cpu", "cuda")
    rows = [(r["domain"] or "ai.onnx", r["op_type"], r["gradient"], "yes" if r["cpu"] else "no",
             "yes" if r["cuda"] else "no") for r in table]
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    typer.echo(f"{len(rows)} ops")


@app.command("check")
def check(
    model: Path = typer.Argument(..., help="Forward ONNX model whose graph computes the loss."),
    loss: Optional[str] = typer.Option(None, "--loss", help="Graph output to differentiate (as in build-backward)."),
    wrt: Optional[List[str]] = typer.Option(None, "--wrt", help="Check the gradient of this tensor (repeatable)."),
    freeze: Optional[List[str]] = typer.Option(None, "--freeze", help="Exclude this tensor (repeatable)."),
    wrt_inputs: bool = typer.Option(False, "--wrt-inputs", help="Also check every float graph input."),
    inputs: Optional[Path] = typer.Option(None, "--inputs", help=".npz file with one array per graph input."),
    random_inputs: bool = typer.Option(False, "--random-inputs", help="Draw inputs from the declared types and shapes."),
    seed: int = typer.Option(0, "--seed", help="Seed for --random-inputs and the random directions."),
    dim: Optional[List[str]] = typer.Option(None, "--dim", help="NAME=VALUE for a symbolic dimension (repeatable)."),
    samples: int = typer.Option(3, "--samples", help="Random directions per tensor."),
    rtol: float = typer.Option(1e-5, "--rtol", help="Tolerance relative to the size of the compared gradient."),
    atol: float = typer.Option(1e-7, "--atol", help="Absolute tolerance."),
    device: str = typer.Option("cpu", "--device", help="auto, cpu or cuda."),
) -> None:
    """Compare the backward graph with float64 finite differences of MODEL; exit 4 on a mismatch."""
    from gradgen.check import check_gradients
    from gradgen.errors import RunError
    from gradgen.inputs import parse_dims

    dims = parse_dims(dim or [])
    started = time.perf_counter()
    report = check_gradients(model, loss=loss, wrt=wrt, freeze=freeze or (), wrt_inputs=wrt_inputs,
                             inputs=inputs, random_inputs=random_inputs, seed=seed, dims=dims,
                             samples=samples, rtol=rtol, atol=atol, device=device)
    typer.echo(f"loss: {report.loss} (float64, central differences, eps={report.eps:g})")
    typer.echo(report.format())
    seconds = time.perf_counter() - started
    if not report.passed:
        raise RunError(f"gradient check failed for {len(report.failures)} of {len(report.tensors)} tensor(s): "
                       f"{', '.join(report.failures)}")
    typer.echo(f"all {len(report.tensors)} gradient(s) match finite differences ({seconds:.2f} s)")


@app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                         "help_option_names": []})
def bench(ctx: typer.Context) -> None:
    """Time gradgen against PyTorch and ONNX Runtime: GPU kernels, real-size training steps (--only e2e),
    the CPU path (--only cpu). 'gradgen bench --help' lists the groups and options."""
    from gradgen.bench import run as bench_run

    argv = list(ctx.args)  # the options are gradgen.bench's own (one home for them)
    if _state["debug"] and "--debug" not in argv:
        argv.append("--debug")
    bench_run(argv)


def _click_exception_type() -> type:
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


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point: every error becomes one line on stderr and a documented exit code."""
    _state["debug"] = False
    args = _hoist_debug(list(sys.argv[1:] if argv is None else argv))
    click_exception = _click_exception_type()
    try:
        code = app(args=args, prog_name="gradgen", standalone_mode=False)
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
