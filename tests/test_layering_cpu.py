"""The import layering of KERNELS.md, checked on the source: kernel packages never import one another, api/ never
imports a kernel, compile/ or ref/, and the bottom layers import nothing above them."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "cutedsl_attn"
KERNEL_PKGS = ("portable", "sm90", "sm100")


def _imports(path: pathlib.Path) -> set[str]:
    """The cutedsl_attn subpackages (first component) a module imports, relative imports resolved."""
    rel = path.relative_to(PKG).with_suffix("").parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel[:-1])[: len(rel) - node.level] if node.level > 1 else list(rel[:-1])
                parts = base + (node.module.split(".") if node.module else [])
                if not parts:  # "from .. import x" at the top: x is the subpackage
                    parts = [a.name for a in node.names]
                    out.update(parts)
                    continue
                out.add(parts[0])
            elif node.module and node.module.startswith("cutedsl_attn."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("cutedsl_attn."):
                    out.add(a.name.split(".")[1])
    return out


def _modules(sub: str):
    return sorted((PKG / sub).rglob("*.py"))


@pytest.mark.parametrize("pkg", KERNEL_PKGS)
def test_kernel_packages_do_not_import_one_another(pkg):
    for path in _modules(pkg):
        bad = _imports(path) & (set(KERNEL_PKGS) - {pkg})
        assert not bad, f"{path.relative_to(PKG)} imports kernel package(s) {sorted(bad)}"


def test_api_imports_no_kernel_compile_or_ref():
    for path in _modules("api"):
        bad = _imports(path) & {*KERNEL_PKGS, "compile", "ref"}
        assert not bad, f"{path.relative_to(PKG)} imports {sorted(bad)}"


@pytest.mark.parametrize("sub", ["planning", "compile", "ref", "cudnn"])
def test_bottom_layers_import_nothing_above(sub):
    above = {*KERNEL_PKGS, "api", "dispatch", "common", "attention", "_demo", "inspect", "selfcheck",
             "selfcheck_cli"} - {sub}
    for path in _modules(sub):
        bad = _imports(path) & above
        assert not bad, f"{path.relative_to(PKG)} imports {sorted(bad)}"


# device helpers whose one home is common/: a kernel module defines none of these names (with or without a
# leading underscore) nor another 128-byte-swizzle offset function ("sw128" in its name); it imports them
SHARED_HELPER_MODULES = ("smem",)
# copies still to be replaced by imports of common.smem (removing one removes its entry)
KNOWN_COPIES: set[tuple[str, str]] = set()


def _function_names(path: pathlib.Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef,
                                                                                   ast.AsyncFunctionDef))}


def test_common_helpers_have_no_copies_in_kernel_packages():
    shared = set()
    for mod in SHARED_HELPER_MODULES:
        shared |= {n for n in _function_names(PKG / "common" / f"{mod}.py") if not n.startswith("_")}
    assert {"sw128_offset", "transpose_view"} <= shared
    for pkg in KERNEL_PKGS:
        for path in _modules(pkg):
            rel = path.relative_to(PKG).as_posix()
            copies = {n for n in _function_names(path) if n.lstrip("_") in shared or "sw128" in n}
            copies -= {n for p, n in KNOWN_COPIES if p == rel}
            assert not copies, f"{rel} defines {sorted(copies)}: import them from cutedsl_attn.common instead"
