"""The packages depend only downward (docs/contributing.md): every import of every module.

engine may import the three others; preprocessing only collectives (and
``kernels.files``); collectives only ``kernels.numba_target`` and
``kernels.files``; kernels nothing of mpidp. Inside engine, ``engine.nn``
(the models) imports nothing of ``engine.dp`` (privacy), and ``engine.dp``
nothing of what composes a run. Imports inside functions (deferred ones)
count as much as those at the top of a file.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "preprocessing", "collectives", "kernels")

#: What each package may import of the other packages (a module and everything
#: below it): the contributing page's diagram.
ALLOWED = {
    "engine": ("collectives", "kernels", "preprocessing"),
    "preprocessing": ("collectives", "kernels.files"),
    "collectives": ("kernels.numba_target", "kernels.shared_compiles", "kernels.files"),
    "kernels": (),
}

#: Inside engine: what a sub-package may import of engine itself.
ENGINE_INSIDE = {
    "engine.nn": ("engine.nn", "engine.errors", "engine.choices"),
    "engine.dp": ("engine.dp", "engine.nn", "engine.errors", "engine.choices"),
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str, root: Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file at ``path``, at any depth;
    ``from P import name`` gives ``P.name`` where that is a module of the tree."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((node.lineno, full if _is_module(full, root) else base))
    return out


def _under(target: str, prefixes) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def violations(root: Path = ROOT) -> list[str]:
    """One line per import that breaks the layering: ``file:line: module imports target``."""
    problems = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            name = module_name(path, root)
            for line, target in imports_of(path, root):
                top = target.split(".")[0]
                where = f"{path.relative_to(root)}:{line}: {name} imports {target}"
                if top in PACKAGES and top != package and not _under(target, ALLOWED[package]):
                    problems.append(f"{where} (allowed: {', '.join(ALLOWED[package]) or 'none'})")
                for inside, allowed in ENGINE_INSIDE.items():
                    if _under(name, [inside]) and top == "engine" and not _under(target, allowed):
                        problems.append(f"{where} ({inside} may import of engine only "
                                        f"{', '.join(allowed)})")
    return problems


def test_every_import_goes_downward():
    problems = violations()
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_the_check_finds_what_breaks_the_layering(tmp_path):
    def write(relative: str, text: str = "") -> None:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")

    for package in PACKAGES:
        write(f"{package}/__init__.py")
    for module in ("kernels/files.py", "engine/errors.py", "engine/models.py",
                   "engine/trainer.py"):
        write(module)
    write("kernels/numba_target.py")
    write("kernels/registry.py", "import os\n")
    write("collectives/ok.py", "import kernels.numba_target\nfrom kernels import files\n")
    write("collectives/up.py", "def f():\n    from engine import trainer\n")  # deferred: counts
    write("collectives/side.py", "from kernels import registry\n")
    write("preprocessing/ok.py", "from collectives import MPI\nimport kernels.files\n")
    write("preprocessing/skip.py", "from kernels.registry import fused\n")
    write("kernels/up.py", "from . import files\nimport collectives\n")
    write("engine/nn/__init__.py")
    write("engine/nn/mlp.py", "from engine.errors import X\nfrom .. import dp\n")
    write("engine/dp/__init__.py", "from engine.nn import mlp\nfrom engine import models\n")
    found = sorted(p.split(" (")[0] for p in violations(tmp_path))
    assert found == [
        "collectives/side.py:1: collectives.side imports kernels.registry",
        "collectives/up.py:2: collectives.up imports engine.trainer",
        "engine/dp/__init__.py:2: engine.dp imports engine.models",
        "engine/nn/mlp.py:2: engine.nn.mlp imports engine.dp",
        "kernels/up.py:2: kernels.up imports collectives",
        "preprocessing/skip.py:1: preprocessing.skip imports kernels.registry",
    ], found
