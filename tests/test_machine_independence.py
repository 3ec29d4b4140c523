"""A test's verdict must not depend on the CPU it runs on: values recorded on one machine and
committed under `tests/fixtures/` are compared within a tolerance, never bitwise (matrix products
round differently across CPU models). Bitwise comparisons stay legitimate within one process."""
import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
BITWISE = {"equal", "array_equal"}  # torch.equal, numpy.array_equal


def _reads_fixture(node: ast.AST) -> bool:
    """True when the function's body names the committed fixtures folder."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "FIXTURES":
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and "fixtures" in sub.value:
            return True
    return False


def _bitwise_calls(node: ast.AST) -> list[int]:
    return [sub.lineno for sub in ast.walk(node)
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
            and sub.func.attr in BITWISE]


def bitwise_fixture_comparisons(source: str) -> list[str]:
    """`name:line` of every bitwise tensor comparison inside a function that reads a fixture."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _reads_fixture(node):
            found += [f"{node.name}:{line}" for line in _bitwise_calls(node)]
    return found


def test_no_test_compares_a_committed_fixture_bitwise():
    offenders = []
    for path in sorted(TESTS.glob("test_*.py")):
        offenders += [f"{path.name}::{where}" for where in bitwise_fixture_comparisons(path.read_text())]
    assert offenders == [], ("compare values recorded on another machine within a tolerance "
                             f"(torch.testing.assert_close), not bitwise: {offenders}")


def test_the_check_sees_a_bitwise_fixture_comparison():
    bad = ("def test_x():\n    e = torch.load(FIXTURES / 'a.pt')\n"
           "    assert torch.equal(model(e['batch']), e['logits'])\n")
    good = ("def test_y():\n    e = torch.load(FIXTURES / 'a.pt')\n"
            "    torch.testing.assert_close(model(e['batch']), e['logits'])\n"
            "def test_z():\n    assert torch.equal(a, b)\n")
    assert bitwise_fixture_comparisons(bad) == ["test_x:3"]
    assert bitwise_fixture_comparisons(good) == []
