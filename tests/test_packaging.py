"""The install: one import name (``moekit``), layers that import only downwards, no path hacks.

    moekit.moe     -> nothing of ours (and never torch.distributed)
    moekit.comm    -> moe
    moekit.models  -> comm, moe          (the model definition never imports torch.distributed)
    moekit.train   -> models, comm, moe  (the application layer: trainer, heatmap, convert, planning)
    moekit.bench   -> everything         (tools/bench: benchmarks)

The wheel test builds the real wheel (setuptools, no network) and reads its file list.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"moe": "moe", "comm": "comm", "models": "models", "train": "train", "bench": "tools/bench"}
ALLOWED = {  # layer -> the layers it may import
    "moe": {"moe"},
    "comm": {"comm", "moe"},
    "models": {"models", "comm", "moe"},
    "train": {"train", "models", "comm", "moe"},
    "bench": {"bench", "train", "models", "comm", "moe"},
}
OLD_TOP_LEVEL = {"moe", "comm", "models", "trainlib", "train", "benchlib", "heatmap", "convert", "tools"}


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (relative imports resolved in ``package``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                out.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                out.append((node.lineno, node.module))
    return out


def layer_files():
    for layer, folder in LAYERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            package = ".".join(["moekit", layer, *parts[: len(parts) - (path.name != "__init__.py")]])
            yield layer, path, package


def test_layer_imports_point_down():
    bad = []
    for layer, path, package in layer_files():
        for line, mod in imported_modules(path, package):
            where = f"{path.relative_to(ROOT)}:{line}"
            top = mod.split(".")
            if top[0] == "moekit":
                if len(top) < 2 or top[1] not in ALLOWED[layer]:
                    bad.append(f"{where} ({layer}) imports {mod}")
            elif top[0] in OLD_TOP_LEVEL:
                bad.append(f"{where} imports the old top-level name {mod}")
            if mod.startswith("torch.distributed") and (
                    layer == "moe" or path.relative_to(ROOT).as_posix() in ("models/transformer.py", "models/config.py")):
                bad.append(f"{where}: {layer} single-device code imports {mod}")
    assert not bad, "\n".join(bad)


def test_checker_sees_a_violation(tmp_path):
    """The walk above finds relative and absolute imports (else the layering test could never fail)."""
    f = tmp_path / "x.py"
    f.write_text("from ..comm import topology\nimport moekit.train.loop\nfrom . import y\n")
    mods = [m for _, m in imported_modules(f, "moekit.moe.kernels")]
    assert mods == ["moekit.moe.comm", "moekit.train.loop", "moekit.moe.kernels"]


def test_no_sys_path_edits_in_tools_or_tests():
    edits = tuple("sys.path" + op for op in (".insert", ".append", "["))  # spelled so this file has none
    hits = [str(p.relative_to(ROOT)) for folder in ("tools", "tests", "train", "moe", "comm", "models")
            for p in (ROOT / folder).rglob("*.py")
            if any(e in p.read_text() for e in edits)]
    assert not hits, hits


@pytest.mark.slow
def test_wheel_holds_only_the_moekit_namespace(tmp_path):
    pytest.importorskip("setuptools")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("moekit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"moekit", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert "moekit/__init__.py" not in names  # a namespace package: nothing in the checkout can shadow it
    for layer in ("moe", "moe/kernels", "comm", "models", "models/hf", "train", "train/planning", "bench"):
        assert f"moekit/{layer}/__init__.py" in names, layer
    dist_info = next(t for t in tops if t.endswith(".dist-info"))
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    for script in SCRIPTS:
        assert script in entry_points
    top_level = [n for n in names if n.endswith("top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["moekit"]

    # Installed (not editable) beside another distribution's top-level ``comm`` (Jupyter's), the two coexist,
    # and the layers import from a directory outside the checkout.
    target = tmp_path / "site"
    (target / "comm").mkdir(parents=True)
    (target / "comm" / "__init__.py").write_text("def create_comm(*args, **kwargs):\n    return 'jupyter'\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    code = ("import comm, moekit.moe, moekit.comm, moekit.models, moekit.train, moekit.models.hf; "
            "print(comm.create_comm(), moekit.moe.__file__)")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(target), "PYTHONSAFEPATH": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    said, where = run.stdout.split()
    assert said == "jupyter" and Path(where).is_relative_to(target), run.stdout


SCRIPTS = ("moekit-train", "moekit-heatmap", "moekit-convert", "moekit-prepare", "moekit-generate", "moekit-eval", "moekit-sweep",
           "moekit-placement", "moekit-launch")


def test_console_scripts_run_outside_the_checkout(tmp_path):
    """The installed ``moekit-*`` programs answer --help from a directory that is not the checkout."""
    bindir = Path(sys.executable).parent
    for script in SCRIPTS:
        exe = bindir / script
        if not exe.exists():
            pytest.skip(f"{script} is not installed next to {sys.executable} (moekit not pip-installed)")
        proc = subprocess.run([str(exe), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "usage:" in proc.stdout and script in proc.stdout, proc.stderr[-1000:]
