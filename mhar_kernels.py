"""Makes `import mhar_kernels` work from a plain checkout (repository root on sys.path, no install).

The package lives in the folder kernels/ (installed under the name `mhar_kernels`, see
pyproject.toml). An editable or regular install finds the same files; this file only loads
them under that name when nothing is installed.
"""
import importlib.util
import pathlib
import sys

_folder = pathlib.Path(__file__).resolve().parent / "kernels"
_spec = importlib.util.spec_from_file_location(
    __name__, _folder / "__init__.py", submodule_search_locations=[str(_folder)]
)
_package = importlib.util.module_from_spec(_spec)
sys.modules[__name__] = _package  # the import statement returns this entry
_spec.loader.exec_module(_package)
