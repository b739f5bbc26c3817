"""The package has no import circles: walked over module- and function-level imports, relative and
absolute, of mlxspec/ and the models/, converters/ and cli/ folders it installs as subpackages.

Why: a circle means two modules cannot be read, loaded or moved apart; lazy imports only hide one
until a call order changes. The walk is scripts/architecture_metrics.py's, which also reports it.
"""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "architecture_metrics.py"


def _metrics():
    spec = importlib.util.spec_from_file_location("architecture_metrics", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_imports_in_no_circle():
    metrics = _metrics()
    circles = metrics.import_circles(metrics.import_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_walk_finds_a_circle_through_a_function_level_relative_import(tmp_path):
    """A walk that saw nothing would pass the test above; this one plants a circle."""
    package = tmp_path / "mlxspec"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "top.py").write_text("from .sub import low\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "low.py").write_text("def f():\n    from .. import top\n")
    metrics = _metrics()
    graph = metrics.import_graph(tmp_path)
    assert metrics.import_circles(graph) == [["mlxspec.sub.low", "mlxspec.top"]]
