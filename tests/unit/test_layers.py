"""The tree's layers do not reach up: the library (``gyre``) imports no service and no
application; a service imports no other service and no application; the product (library,
services, applications, simulator) imports no test code; benchmarks and the test kit
(``testkit``: every fake, rig and PKI helper) import no test module; no test module imports
another (what two tests share lives in ``testkit`` or a ``conftest.py``). Checked on the
source with ``ast`` (every ``import`` and ``from ... import``, function-level imports
included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists())


def _imports(path: Path, type_checking: bool = True) -> set[str]:
    """Every module ``path`` imports (``import`` and ``from ... import``, function level
    included); with ``type_checking`` False, not those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _violations(top: str, forbidden) -> list[str]:
    bad = []
    for path in sorted((ROOT / top).rglob("*.py")):
        for mod in _imports(path):
            why = forbidden(path, mod)
            if why:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}: {why}")
    return bad


def _is(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def _above(mod: str, layer: str, ups: tuple[str, ...]) -> str:
    """Why ``layer`` may not import ``mod`` (one of ``ups``, the tops that stand above it),
    or "" when ``mod`` is none of them."""
    for up in ups:
        if _is(mod, up):
            return f"{layer} stands below {up}"
    return ""


def test_library_imports_no_service_application_or_test() -> None:
    def forbidden(path: Path, mod: str) -> str:
        return _above(mod, "the library", ("services", "apps", "tests", "testkit", "bench", "sim"))

    assert _violations("gyre", forbidden) == []


def test_services_import_no_other_service_application_or_test() -> None:
    def forbidden(path: Path, mod: str) -> str:
        own = path.relative_to(ROOT / "services").parts[0]
        for svc in SERVICES:
            if svc != own and _is(mod, f"services.{svc}"):
                return "services talk over gRPC, never import each other"
        return _above(mod, "a service", ("apps", "tests", "testkit", "bench", "sim"))

    assert _violations("services", forbidden) == []


def test_applications_and_the_simulator_import_no_test_code() -> None:
    def forbidden(path: Path, mod: str) -> str:
        return "test code is for tests only" if _is(mod, "tests") or _is(mod, "testkit") else ""

    assert [v for top in ("apps", "sim") for v in _violations(top, forbidden)] == []


def test_benchmarks_and_the_test_kit_import_no_test_module() -> None:
    def forbidden(path: Path, mod: str) -> str:
        return "a test module is no library: share through testkit" if _is(mod, "tests") else ""

    assert [v for top in ("bench", "testkit") for v in _violations(top, forbidden)] == []


def _is_test_module(mod: str) -> bool:
    return _is(mod, "tests") and any(part.startswith("test_") for part in mod.split("."))


def test_no_test_module_imports_another() -> None:
    def forbidden(path: Path, mod: str) -> str:
        return "share through testkit or a conftest.py" if _is_test_module(mod) else ""

    assert _violations("tests", forbidden) == []


def test_no_test_modules_inside_services() -> None:
    names = ("testing.py", "fakes.py", "testkit.py", "conftest.py")
    found = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "services").rglob("*.py")
        if p.name in names or p.name.startswith("test_")
    ]
    assert found == []


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from services.router import calls\n")
    assert "services.router.calls" in _imports(mod)


def _runtime_imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports when it runs: every import, function
    level included, but not those under ``if TYPE_CHECKING:``."""
    return _imports(path, type_checking=False) & known


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (depth first), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_cycles() -> None:
    paths = {}
    for top in ("gyre", "services", "apps", "sim", "bench", "testkit"):
        for p in (ROOT / top).rglob("*.py"):
            if "v1" not in p.relative_to(ROOT).parts:
                paths[".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = p
    known = set(paths)
    graph = {
        mod: {dep for dep in _runtime_imports(p, known) if dep != mod and not mod.startswith(dep + ".")}
        for mod, p in paths.items()
    }
    assert _cycle(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
