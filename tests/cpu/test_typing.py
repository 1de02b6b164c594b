"""Signatures for editors and type checkers, seen from the installed package: inspect.signature answers
for every public callable and agrees with the shipped stub (cai_dlpack/_core.pyi, with py.typed), mypy's
stubtest finds the stub true to the module, and mypy --strict accepts tests/typing/usage.py (the whole
public API) and rejects each marked line of tests/typing/misuse.py."""
import ast
import inspect
import os
import re
import subprocess
import sys

import pytest

import cai_dlpack
from cai_dlpack import DLPackShim, DLPackView

PACKAGE = os.path.dirname(os.path.abspath(cai_dlpack.__file__))
STUB = os.path.join(PACKAGE, "_core.pyi")
TYPING = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "typing")

# Every public callable of the extension module, by the name the stub gives it. For a class, its
# constructor; for a method, the unbound descriptor (its first parameter, self or cls, is not compared).
EXTENSION_CALLABLES = {
    "cai2dlpack": cai_dlpack.cai2dlpack,
    "dlpack2cai": cai_dlpack.dlpack2cai,
    "options": cai_dlpack.options,
    "cuda_runtime_info": cai_dlpack.cuda_runtime_info,
    "DLPackShim.__new__": DLPackShim,
    "DLPackShim.__dlpack__": DLPackShim.__dlpack__,
    "DLPackShim.__dlpack_device__": DLPackShim.__dlpack_device__,
    "DLPackView.__dlpack__": DLPackView.__dlpack__,
    "DLPackView.__dlpack_device__": DLPackView.__dlpack_device__,
}
PUBLIC_CALLABLES = dict(EXTENSION_CALLABLES, get_include=cai_dlpack.get_include)


def stub_functions():
    """name ('f' or 'Class.f') -> the stub's ast.FunctionDef."""
    with open(STUB) as file:
        tree = ast.parse(file.read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found.update((f"{node.name}.{item.name}", item) for item in node.body if isinstance(item, ast.FunctionDef))
    return found


def stub_parameters(function, drop_first):
    """(name, kind, default text or None) of each parameter the stub declares."""
    arguments = function.args
    positional = arguments.posonlyargs + arguments.args
    defaults = [None] * (len(positional) - len(arguments.defaults)) + arguments.defaults
    kinds = ["POSITIONAL_ONLY"] * len(arguments.posonlyargs) + ["POSITIONAL_OR_KEYWORD"] * len(arguments.args)
    result = [(a.arg, kind, d) for a, kind, d in zip(positional, kinds, defaults)]
    if arguments.vararg:
        result.append((arguments.vararg.arg, "VAR_POSITIONAL", None))
    result += [(a.arg, "KEYWORD_ONLY", d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults)]
    if arguments.kwarg:
        result.append((arguments.kwarg.arg, "VAR_KEYWORD", None))
    result = [(name, kind, None if d is None else ast.unparse(d)) for name, kind, d in result]
    return result[1:] if drop_first else result


def runtime_parameters(signature, drop_first):
    result = [(p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default))
              for p in signature.parameters.values()]
    return result[1:] if drop_first else result


def test_the_stub_ships_with_py_typed():
    assert os.path.isfile(STUB) and os.path.isfile(os.path.join(PACKAGE, "py.typed"))


def test_the_stub_names_every_public_name():
    with open(STUB) as file:
        text = file.read()
    for name in cai_dlpack.__all__:
        if name != "get_include":  # plain Python, typed in __init__.py itself
            assert re.search(rf"^(class |def )?{name}\b", text, re.MULTILINE), name


@pytest.mark.parametrize("name", sorted(PUBLIC_CALLABLES))
def test_inspect_signature_answers(name):
    # Extension functions need a text signature ("name(...)\n--\n\n" at the head of their C docstring).
    signature = inspect.signature(PUBLIC_CALLABLES[name])
    assert isinstance(signature, inspect.Signature)


@pytest.mark.parametrize("name", sorted(EXTENSION_CALLABLES))
def test_runtime_signature_matches_the_stub(name):
    declared = stub_functions()[name]
    is_method = "." in name
    signature = inspect.signature(EXTENSION_CALLABLES[name])
    # inspect.signature of a class already leaves out cls; of an unbound method it keeps self.
    runtime = runtime_parameters(signature, drop_first=is_method and not name.endswith("__new__"))
    assert runtime == stub_parameters(declared, drop_first=is_method)


def test_mypy_strict_accepts_the_usage_and_rejects_the_misuse(tmp_path):
    usage, misuse = (os.path.abspath(os.path.join(TYPING, name)) for name in ("usage.py", "misuse.py"))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-color-output", "--cache-dir", str(tmp_path / "cache"),
         usage, misuse],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)  # cwd: only the installed package is seen
    errors = re.findall(r"^(.*?\.py):(\d+): error: (.*)$", result.stdout, re.MULTILINE)
    assert [e for e in errors if os.path.basename(e[0]) != "misuse.py"] == [], result.stdout + result.stderr
    with open(misuse) as file:
        marked = {number for number, line in enumerate(file, 1) if "  # rejected: " in line}
    assert marked and {int(number) for _, number, _ in errors} == marked, result.stdout + result.stderr
    assert result.returncode == 1


def test_stubtest_finds_the_stub_true_to_the_module(tmp_path):
    allowlist = os.path.abspath(os.path.join(TYPING, "stubtest_allowlist.txt"))
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "cai_dlpack._core", "--allowlist", allowlist,
         "--ignore-unused-allowlist", "--mypy-config-file", os.devnull],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
