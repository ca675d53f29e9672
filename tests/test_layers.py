"""Layering rules, checked on the source: no module reaches into another layer's private names.

A layer is a package under gradgen/ (grads, passes, executor, ops, training, ...), with the CPU
kernels (gradgen.kernels.cpu) and the CUDA launchers (gradgen.kernels.cuda) counted apart. A
private name (``_x``) is free to change without notice: another layer that needs it needs a
public name (in gradgen/ops when it is op semantics).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradgen"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "kernels" and parts[2] in ("cpu", "cuda"):
        return f"kernels.{parts[2]}"
    return parts[1] if len(parts) > 1 else parts[0]


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def resolve(module: str, level: int, target: str | None) -> str:
    """The absolute module of a (possibly relative) import."""
    if not level:
        return target or ""
    base = module.split(".")[: len(module.split(".")) - level + (1 if module.endswith("__init__") else 0)]
    return ".".join(base + ([target] if target else []))


def private_uses(path: Path, module: str | None = None) -> list[str]:
    """'line: name from module' for every private name of another layer that ``path`` uses
    (``module``: its dotted name, by default from its place under the repository)."""
    module = module or module_name(path)
    own = layer(module)
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}  # local name -> a gradgen module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("gradgen") and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, node.level, node.module)
            if not source.startswith("gradgen"):
                continue
            for a in node.names:
                if is_module(f"{source}.{a.name}"):
                    aliases[a.asname or a.name] = f"{source}.{a.name}"
                elif is_private(a.name) and layer(source) != own:
                    found.append(f"{node.lineno}: {a.name} from {source}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and is_private(node.attr):
            source = aliases.get(node.value.id)
            if source is not None and layer(source) != own:
                found.append(f"{node.lineno}: {node.attr} from {source}")
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))

# Uses still to be removed (the benchmark reaches into the CUDA conv launcher's plan cache; the
# training CLI shares the main CLI's warning helper). Shrink this table; never grow it: an entry no
# longer used fails test_known_private_uses_still_exist.
KNOWN: dict[str, set[str]] = {
    "gradgen.bench.kernels": {"_Geometry", "_GRAPHS", "_STATE", "_dgrad", "_wgrad"},
    "gradgen.training.cli": {"_warnings_as_notes"},
}


def test_the_scan_sees_a_private_import_across_layers(tmp_path):
    """The scanner itself: a CUDA launcher using a CPU kernel's private helper is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from gradgen.kernels.cpu import shape as cpu\nfrom gradgen.kernels.cpu.shape import _hidden\nx = cpu._axis(0, 1)\n"
    )
    assert private_uses(probe, "gradgen.kernels.cuda.probe") == [
        "2: _hidden from gradgen.kernels.cpu.shape",
        "3: _axis from gradgen.kernels.cpu.shape",
    ]


def test_known_private_uses_still_exist():
    """An entry of KNOWN that no longer occurs is removed from the table."""
    for module, names in KNOWN.items():
        path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
        used = {use.split()[1] for use in private_uses(path)}
        assert names <= used, f"{module} no longer uses {sorted(names - used)}: remove them from KNOWN"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_uses_another_layers_private_names(path):
    known = KNOWN.get(module_name(path), set())
    uses = [use for use in private_uses(path) if use.split()[1] not in known]
    assert uses == [], f"{module_name(path)} uses private names of another layer"


# ---------------------------------------------------------------------------------------------
# registration: registries list their families; families never import their registry

REGISTRIES = {
    # package of family modules: (the registry module, its family list, modules that are not families)
    "gradgen.grads.rules": ("gradgen.grads.registry", "FAMILIES", set()),
    "gradgen.kernels.cpu": (
        "gradgen.kernels.registry",
        "CPU_FAMILIES",
        {"prepared", "blas", "onednn", "onednn_conv", "onednn_eltwise", "onednn_rows"},
    ),
    "gradgen.kernels.cuda": (
        "gradgen.kernels.registry",
        "CUDA_FAMILIES",
        {"launch", "fused"},
    ),  # fused: the executor's generated kernels
    "gradgen.passes.lowering": ("gradgen.passes.lowering.core", "FAMILIES", {"core", "table"}),
}


def imported_modules(path: Path) -> set[str]:
    """Modules ``path`` imports when it is imported (top-level statements: a function that looks
    a kernel up at run time registers nothing)."""
    module = module_name(path)
    found = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, node.level, node.module)
            found.add(source)
            found.update(f"{source}.{a.name}" for a in node.names if is_module(f"{source}.{a.name}"))
    return found


@pytest.mark.parametrize("package", sorted(REGISTRIES))
def test_registries_list_every_family_and_families_never_import_their_registry(package):
    import importlib

    registry, attribute, not_families = REGISTRIES[package]
    directory = ROOT.joinpath(*package.split("."))
    files = {p.stem: p for p in directory.glob("*.py") if p.stem != "__init__"}
    families = set(getattr(importlib.import_module(registry), attribute))
    assert families == set(files) - not_families, f"{registry}.{attribute} must list every family module of {package}"
    for name, path in files.items():
        assert registry not in imported_modules(path), f"{package}.{name} imports {registry}, which imports it"


def test_every_tree_uses_the_rule_families_names():
    """An op's family names its file in every tree: a rule family has a CPU kernel family of the
    same name, and so has every CUDA and lowering family."""
    from gradgen.grads.registry import FAMILIES as RULES
    from gradgen.kernels.registry import CPU_FAMILIES, CUDA_FAMILIES
    from gradgen.passes.lowering.core import FAMILIES as LOWERINGS

    assert set(RULES) <= set(CPU_FAMILIES)
    assert set(CUDA_FAMILIES) <= set(CPU_FAMILIES) and set(LOWERINGS) <= set(RULES)


def test_the_ops_layer_imports_no_other_gradgen_layer():
    """gradgen/ops is the bottom layer: every other layer may take op semantics from it. It may use
    the two leaf modules below every layer: errors, and names (how a node or value is named)."""
    for path in sorted((PACKAGE / "ops").glob("*.py")):
        other = {
            m
            for m in imported_modules(path)
            if m.startswith("gradgen")
            and not m.startswith("gradgen.ops")
            and m not in ("gradgen", "gradgen.errors", "gradgen.names")
        }
        assert not other, f"{module_name(path)} imports {sorted(other)}"
