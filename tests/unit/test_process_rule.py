"""One launcher: only services/launch/ (and the router's own supervisor, services/router/processes.py)
start pdmesh's `services.*` processes. Nothing under tests/, bench/, scripts/ or chaos/ calls
subprocess / asyncio / os process creation with a `services.` module (or a services/ script) in
its command line, and no tool outside tests/ imports the tests' code.

The scan reads each file's syntax tree: a process-creating call counts when a string in the call
itself, or bound to a name the call uses (in the same function or at module level), is a
`services.<module>` name or a `services/...py` path, the words a command line carries."""

from __future__ import annotations

import ast
import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = ("tests", "bench", "scripts", "chaos")
NO_TEST_IMPORTS = ("bench", "scripts", "services", "chaos")
SPAWNERS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
    "os": {"system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execlp", "spawnv", "spawnvp",
           "posix_spawn", "posix_spawnp"},
}
SERVICE_WORD = re.compile(r"^(services(\.\w+)+|services/[\w/]+\.py)$")


def _spawner(call: ast.Call) -> bool:
    f = call.func
    if isinstance(f, ast.Attribute):
        base = f.value
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        return f.attr in SPAWNERS.get(name, ())
    return isinstance(f, ast.Name) and f.id in {"Popen", "create_subprocess_exec"}


def _strings(node: ast.AST) -> list[str]:
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.append(n.value)
        elif isinstance(n, ast.JoinedStr) and n.values and isinstance(n.values[0], ast.Constant):
            out.append(str(n.values[0].value) + "x")  # f"services.{role}": its fixed head + a stand-in
    return out


def _bindings(scope: ast.AST) -> dict[str, list[ast.AST]]:
    """Name -> the values assigned to it directly in `scope` (not in nested functions)."""
    out: dict[str, list[ast.AST]] = {}
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        n = stack.pop()
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        if isinstance(n, ast.Assign):
            for t in n.targets:
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        out.setdefault(name.id, []).append(n.value)
        elif isinstance(n, ast.AnnAssign | ast.AugAssign) and isinstance(n.target, ast.Name) and n.value:
            out.setdefault(n.target.id, []).append(n.value)
        stack.extend(ast.iter_child_nodes(n))
    return out


def service_spawns(source: str) -> list[int]:
    """Lines of calls that start a `services.` module (or script) as a process."""
    tree = ast.parse(source)
    module_names = _bindings(tree)
    found = []
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]
    for scope in scopes:
        names = {**module_names, **_bindings(scope)} if scope is not tree else module_names
        stack = list(ast.iter_child_nodes(scope))
        while stack:
            n = stack.pop()
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                continue  # scanned as its own scope
            if isinstance(n, ast.Call) and _spawner(n):
                words = _strings(n)
                for used in ast.walk(n):
                    if isinstance(used, ast.Name):
                        for value in names.get(used.id, []):
                            words += _strings(value)
                if any(SERVICE_WORD.match(w) for w in words):
                    found.append(n.lineno)
            stack.extend(ast.iter_child_nodes(n))
    return sorted(set(found))


def imports_tests(source: str) -> list[int]:
    lines = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import) and any(a.name == "tests" or a.name.startswith("tests.") for a in n.names):
            lines.append(n.lineno)
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and (
                n.module == "tests" or n.module.startswith("tests.")):
            lines.append(n.lineno)
    return lines


def _skipped(name: str) -> bool:
    """Folders that are not the project's code: virtual environments (.venv, bench/.venv-sglang),
    generated code, caches. Pruned, not walked: a venv holds tens of thousands of files."""
    return name.startswith(".") or name in ("generated", "__pycache__")


def _files(top: str):
    found = []
    for folder, dirs, files in os.walk(ROOT / top):
        dirs[:] = [d for d in dirs if not _skipped(d)]
        found += [pathlib.Path(folder) / f for f in files if f.endswith(".py")]
    yield from sorted(found)


def test_the_scan_sees_a_service_started_directly_or_through_a_name():
    direct = 'import subprocess, sys\nsubprocess.Popen([sys.executable, "-m", "services.router", "--port", "1"])\n'
    named = ('import asyncio, sys\nasync def f():\n    cmd = [sys.executable, "-m", "services.decode"]\n'
             '    await asyncio.create_subprocess_exec(*cmd)\n')
    script = 'import subprocess\nsubprocess.run(["python", "services/fakes/sglang_worker.py"])\n'
    fstring = 'import subprocess\nrole = "x"\nsubprocess.run(["python", "-m", f"services.{role}"])\n'
    assert service_spawns(direct) == [2] and service_spawns(named) == [4]
    assert service_spawns(script) == [2] and service_spawns(fstring) == [3]
    # code run with -c that imports from services is not a service started
    inline = 'import subprocess, sys\nCODE = "from services.common import x"\nsubprocess.run([sys.executable, "-c", CODE])\n'
    assert service_spawns(inline) == []
    assert imports_tests("from tests.integration.mesh import Mesh\n") == [1]
    assert imports_tests("import tests.chaos\nfrom services import launch\n") == [1]


def test_only_the_launcher_starts_services_processes():
    offenders = [f"{path.relative_to(ROOT)}:{line}" for top in SCANNED for path in _files(top)
                 for line in service_spawns(path.read_text())]
    assert not offenders, ("start these through services/launch (Launcher, run_service, spawn): "
                           + ", ".join(offenders))


def test_tools_outside_tests_do_not_import_the_tests():
    offenders = [f"{path.relative_to(ROOT)}:{line}" for top in NO_TEST_IMPORTS for path in _files(top)
                 for line in imports_tests(path.read_text())]
    assert not offenders, "bench, scripts, services and chaos must not import tests: " + ", ".join(offenders)
