"""A mutation run over the C core: one command, seeded, never in CI (it takes an hour).

    python tests/mutation/run.py --seed N --count M [--files csrc/x.c ...] [--report PATH] [--list]

Each mutant changes one place of csrc/*.c or csrc/cdl_internal.h (a condition negated, a relation or an
equality swapped, an integer constant moved by one, a call statement deleted, a failure turned into an early
success), is built, and runs the tests of its file first (`pytest -x`), then, if they all pass, the whole CPU
suite. A mutant whose tests fail is killed; one that outlives the whole suite survived. A mutant whose
built module is byte for byte the unmutated one cannot change behaviour and is counted as equivalent
without running anything; so is one named in tests/mutation/equivalent.txt (with the reason).

The work tree is never written: the sources are copied into build/mutation/tree (re-synced from the work
tree at every start, file by file, so the build there stays incremental), the mutant is written there and the
original restored in a `finally`, the module is built with CMake/Ninja in build/mutation/cmake, and copied
with the Python package into build/mutation/pkg, which is put first on PYTHONPATH. A pytest plugin
(guard_plugin.py) refuses to run unless the imported cai_dlpack._core is that file with the SHA-256 of the
mutant just built, and fails a test whose Python child would not find it, so no result is trusted from the
wrong module.

A kill counts only when the test that failed passes on the unmutated module (asked once per test, then
remembered); a test that fails there too is deselected and the mutant run again. A failure naming no test (a
crash, a plugin's error, a hang) counts only when the unmutated module passes the same tests in the same time;
else the mutant is inconclusive. The whole-suite stage leaves out the tests of the build, packaging, typing
stubs and benchmark scripts (SUITE_EXCLUDED).
"""
import argparse
import datetime
import fcntl
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
WORK = os.path.join(ROOT, "build", "mutation")
TREE = os.path.join(WORK, "tree")
CMAKE_DIR = os.path.join(WORK, "cmake")
PKG = os.path.join(WORK, "pkg")
BASELINE_PKG = os.path.join(WORK, "baseline")


def set_workdir(path):
    """Puts the tree, the build, the packages and the lock under path (one folder per run going at once)."""
    global WORK, TREE, CMAKE_DIR, PKG, BASELINE_PKG
    WORK = os.path.abspath(path)
    TREE = os.path.join(WORK, "tree")
    CMAKE_DIR = os.path.join(WORK, "cmake")
    PKG = os.path.join(WORK, "pkg")
    BASELINE_PKG = os.path.join(WORK, "baseline")
HERE = os.path.dirname(os.path.abspath(__file__))
EQUIVALENT_FILE = os.path.join(HERE, "equivalent.txt")

# What is copied into the mutation tree: everything the build and the CPU suite read.
SYNCED = ["CMakeLists.txt", "pyproject.toml", "csrc", "include", "python", "tests"]

# The tests run first for a mutant of each file: the behaviour that file owns. A mutant that passes them
# runs the whole CPU suite.
RELATED_TESTS = {
    "c_api.c": ["test_c_api.py", "test_exchange_consumer.py", "test_exchange_allocator.py", "test_out_of_memory.py",
                "test_every_call_fails.py", "test_ordered_release.py"],
    "cai_to_dlpack.c": ["test_fresh_dict_reader.py", "test_cai_path.py", "test_errors.py", "test_interface_lookup.py",
                        "test_buffer_path.py", "test_streams.py", "test_low_precision.py", "test_copy.py",
                        "test_out_of_memory.py", "test_interface_cache.py", "test_c_api.py",
                        "test_every_call_fails.py", "test_lifetime.py", "test_shim_read_once.py"],
    "copy.c": ["test_copy.py", "test_ordered_release.py", "test_out_of_memory.py", "test_every_call_fails.py"],
    "cuda_runtime.c": ["test_runtime_loader.py", "test_device_context.py", "test_streams.py",
                       "test_graph_capture.py", "test_locks.py", "test_copy.py", "test_every_call_fails.py"],
    "dlpack_to_cai.c": ["test_view_buffer.py", "test_exchange_consumer.py", "test_handed_out_objects.py",
                        "test_lifetime.py", "test_errors.py", "test_streams.py", "test_low_precision.py",
                        "test_graph_capture.py", "test_every_call_fails.py", "test_out_of_memory.py"],
    "dtype.c": ["test_low_precision.py", "test_errors.py", "test_cai_path.py", "test_buffer_path.py",
                "test_fresh_dict_reader.py", "test_dlpack_1_4.py"],
    "exchange_alloc.c": ["test_exchange_allocator.py", "test_every_call_fails.py"],
    "interface_cache.c": ["test_interface_cache.py", "test_cai_path.py", "test_fresh_dict_reader.py"],
    "managed_tensor.c": ["test_lifetime.py", "test_ordered_release.py", "test_handed_out_objects.py",
                         "test_cai_path.py", "test_view_buffer.py", "test_exchange_consumer.py", "test_dlpack_1_4.py",
                         "test_errors.py", "test_out_of_memory.py", "test_copy.py"],
    "module.c": ["test_errors.py", "test_self_check.py", "test_cai_path.py", "test_lifetime.py",
                 "test_out_of_memory.py"],
    "names.c": ["test_errors.py", "test_cai_path.py", "test_out_of_memory.py"],
    "ordered_release.c": ["test_ordered_release.py", "test_lifetime.py", "test_graph_capture.py", "test_locks.py",
                          "test_every_call_fails.py"],
    "shim.c": ["test_shim_read_once.py", "test_shim_kept.py", "test_handed_out_objects.py", "test_cai_path.py", "test_errors.py",
               "test_low_precision.py", "test_lifetime.py"],
    "stream_sync.c": ["test_streams.py", "test_graph_capture.py", "test_lifetime.py", "test_locks.py", "test_c_api.py",
                      "test_device_context.py", "test_every_call_fails.py"],
    "cdl_internal.h": ["test_cai_path.py", "test_view_buffer.py", "test_copy.py", "test_buffer_path.py", "test_errors.py",
                       "test_exchange_allocator.py", "test_graph_capture.py", "test_c_api.py"],
}

# Left out of the whole-suite stage: they check the build, the packaging, typing stubs and the benchmark
# scripts (each builds or runs tools for seconds), never a line of csrc/'s behaviour at run time.
SUITE_EXCLUDED = ["test_typing.py", "test_packaging.py", "test_build_configuration.py",
                  "test_hardening_commands.py", "test_benchmark_results.py", "test_benchmark_helpers.py"]

OPERATORS = ("negate", "relation", "equality", "constant", "delete_call", "early_success")


# --- Reading C: which characters are code -----------------------------------------------------------

def code_masks(lines):
    """For each line, the line with comments, string and character literals blanked (spaces; a literal
    keeps its quotes), and None for a preprocessor line (and its continuations)."""
    masks = []
    in_comment = False
    continuation = False
    for line in lines:
        if continuation or (not in_comment and line.lstrip().startswith("#")):
            masks.append(None)
            continuation = line.rstrip("\n").endswith("\\")
            continue
        out = []
        i = 0
        n = len(line)
        while i < n:
            c = line[i]
            if in_comment:
                if line.startswith("*/", i):
                    in_comment = False
                    out.append("  ")
                    i += 2
                else:
                    out.append(" ")
                    i += 1
            elif line.startswith("/*", i):
                in_comment = True
                out.append("  ")
                i += 2
            elif line.startswith("//", i):
                out.append(" " * (n - i))
                break
            elif c in "\"'":
                j = i + 1
                while j < n and line[j] != c:
                    j += 2 if line[j] == "\\" else 1
                out.append(c + " " * (min(j, n) - i - 1) + (c if j < n else ""))
                i = j + 1
            else:
                out.append(c)
                i += 1
        masks.append("".join(out)[:n])
    return masks


FUNCTION_HEADER = re.compile(r"^(?:static\s+|inline\s+|CDL_\w+\s+)*([A-Za-z_][\w\s\*]*?)\b([A-Za-z_]\w*)\s*\(")
KEYWORDS = {"if", "while", "for", "switch", "return", "sizeof", "do", "else", "case", "goto", "defined"}


def enclosing_functions(lines, masks):
    """For each line, (function name, return type text) of the function whose body holds it, from the
    last header at column 0 above it."""
    result = []
    current = ("", "")
    for line, mask in zip(lines, masks):
        if mask is not None and mask[:1].isalpha():
            # (an attribute before the name, `static __attribute__((noinline)) int f(`, is not the name)
            m = FUNCTION_HEADER.match(re.sub(r"__attribute__\s*\(\(.*?\)\)\s*", "", mask))
            if m and m.group(2) not in KEYWORDS and not mask.rstrip().endswith(";"):
                current = (m.group(2), " ".join(m.group(1).split()))
        result.append(current)
    return result


def matching_paren(mask, start):
    """Index of the ')' closing the '(' at start on the same line, or -1."""
    depth = 0
    for i in range(start, len(mask)):
        if mask[i] == "(":
            depth += 1
        elif mask[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


RELATION = re.compile(r"(?<![<>\-=!])(<=|>=|<|>)(?![<>=])")
EQUALITY = re.compile(r"(==|!=)")
INTEGER = re.compile(r"(?<![\w.])(-?)(0[xX][0-9a-fA-F]+|\d+)([uUlL]*)(?![\w.])")
CONDITION = re.compile(r"\b(if|while)\s*\(")
CALL_STATEMENT = re.compile(r"^(\s*)([A-Za-z_]\w*)\s*\(")
RETURN_FAILURE = re.compile(r"\breturn\s+-1\s*;")
GOTO_FAILURE = re.compile(r"\bgoto\s+(fail\w*|error\w*|cleanup\w*|done\w*|out\w*)\s*;")


class Site:
    """One mutant: lines [first, last] (0-based) of path replaced by `replacement` lines."""

    def __init__(self, path, first, last, operator, replacement, lines, function):
        self.path = path
        self.first = first
        self.last = last
        self.operator = operator
        self.replacement = replacement
        self.original = lines[first:last + 1]
        self.function = function
        self.occurrence = None  # k when the same change can be made at several places of the function

    @property
    def file(self):
        return os.path.basename(self.path)

    @property
    def base_id(self):
        """file, function, operator, the original and the mutated text (stripped, one line): the same for every
        place of a function where the same line is changed the same way (three `return -1;` of one function)."""
        before = " ".join(" ".join(self.original).split())
        after = " ".join(" ".join(self.replacement).split())
        return " :: ".join([self.file, self.function, self.operator, before, after])

    @property
    def stable_id(self):
        """The key of tests/mutation/equivalent.txt, naming this one site: the base id, its function followed by
        #k where the same change can be made at several places of the function (k counts them from the top).
        Survives edits elsewhere in the file."""
        if self.occurrence is None:
            return self.base_id
        before = " ".join(" ".join(self.original).split())
        after = " ".join(" ".join(self.replacement).split())
        return " :: ".join([self.file, f"{self.function}#{self.occurrence}", self.operator, before, after])

    def describe(self):
        return {"file": os.path.relpath(self.path, TREE), "line": self.first + 1, "function": self.function,
                "operator": self.operator, "original": "".join(self.original).rstrip("\n"),
                "mutated": "".join(self.replacement).rstrip("\n"), "id": self.stable_id}


def sites_of(path):
    with open(path) as f:
        lines = f.readlines()
    masks = code_masks(lines)
    functions = enclosing_functions(lines, masks)
    sites = []

    def replace(index, start, end, text, operator):
        line = lines[index]
        sites.append(Site(path, index, index, operator, [line[:start] + text + line[end:]], lines,
                          functions[index][0]))

    for index, mask in enumerate(masks):
        if mask is None or not functions[index][0] or not mask.strip():
            continue
        line = lines[index]
        for m in CONDITION.finditer(mask):
            open_at = m.end() - 1
            close_at = matching_paren(mask, open_at)
            if close_at > 0:
                inner = line[open_at + 1:close_at]
                replace(index, open_at, close_at + 1, "(!(" + inner + "))", "negate")
        for m in RELATION.finditer(mask):
            token = m.group(1)
            swapped = {"<": "<=", "<=": "<", ">": ">=", ">=": ">"}[token]
            replace(index, m.start(1), m.end(1), swapped, "relation")
        for m in EQUALITY.finditer(mask):
            replace(index, m.start(1), m.end(1), "!=" if m.group(1) == "==" else "==", "equality")
        for m in INTEGER.finditer(mask):
            if re.search(r"\breturn\b", mask) and m.group(1) == "-" and m.group(2) == "1":
                # -1 returned is the error return every caller tests with `< 0`: -2 is the same, and 0 is
                # the early_success operator.
                continue
            # Array sizes in declarations and case labels move too: both compile, and either can matter.
            # A minus sign belongs to the literal where it is not a binary minus (`return -1`, `= -1`).
            before = mask[:m.start()].rstrip()
            operand_before = bool(before) and (before[-1].isalnum() or before[-1] in "_)]") and \
                not re.search(r"\b(return|case)$", before)
            negative = m.group(1) == "-" and not operand_before
            start = m.start() if negative else m.start(2)
            value = int(m.group(2), 0) * (-1 if negative else 1)
            for moved in (value + 1, value - 1):
                if moved < 0 and not negative:
                    continue
                digits = hex(abs(moved)) if m.group(2).lower().startswith("0x") else str(abs(moved))
                text = ("-" if moved < 0 else "") + digits + m.group(3)
                replace(index, start, m.end(), text, "constant")
        m = RETURN_FAILURE.search(mask)
        if m:
            replace(index, m.start(), m.end(), "return 0;", "early_success")
        m = GOTO_FAILURE.search(mask)
        if m:
            # The failure path skipped: in an int function it returns success at once; elsewhere the code
            # goes on as if the step had worked.
            text = "return 0;" if functions[index][1] in ("int", "static int") else ";"
            replace(index, m.start(), m.end(), text, "early_success")
        m = CALL_STATEMENT.match(mask)
        if m and m.group(2) not in KEYWORDS:
            # A whole statement `name(...);` (its result unused), possibly over several lines.
            depth = 0
            end = None
            for j in range(index, min(index + 8, len(masks))):
                if masks[j] is None:
                    break
                text = masks[j] if j != index else mask[m.end() - 1:]
                for k, c in enumerate(text):
                    if c == "(":
                        depth += 1
                    elif c == ")":
                        depth -= 1
                        if depth == 0:
                            rest = text[k + 1:].strip()
                            if rest == ";":
                                end = j
                            break
                if depth == 0:
                    break
            if end is not None:
                indent = m.group(1)
                replacement = [indent + ";\n"] + ["\n"] * (end - index)
                sites.append(Site(path, index, end, "delete_call", replacement, lines, functions[index][0]))
    # An id names one site: an equivalence written for one `return -1;` must not cover its function's others.
    same = {}
    for site in sorted(sites, key=lambda site: site.first):
        same.setdefault(site.base_id, []).append(site)
    for group in same.values():
        if len(group) > 1:
            for k, site in enumerate(group, 1):
                site.occurrence = k
    return sites, lines


def sample_sites(files, seed, count):
    """count distinct sites: a file drawn with probability proportional to its size (lines), then a site of
    it drawn uniformly; seeded."""
    rng = random.Random(seed)
    pools = {}
    weights = {}
    for path in files:
        sites, lines = sites_of(path)
        rng_file = random.Random(f"{seed}:{os.path.basename(path)}")
        rng_file.shuffle(sites)
        pools[path] = sites
        weights[path] = len(lines)
    chosen = []
    while len(chosen) < count:
        live = [p for p in files if pools[p]]
        if not live:
            break
        path = rng.choices(live, weights=[weights[p] for p in live])[0]
        chosen.append(pools[path].pop())
    return chosen


# --- Equivalent mutants named by hand ----------------------------------------------------------------

def read_equivalents():
    """tests/mutation/equivalent.txt: `id :: reason` per entry (the id is five ` :: `-separated fields)."""
    named = {}
    if not os.path.exists(EQUIVALENT_FILE):
        return named
    with open(EQUIVALENT_FILE) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            fields = line.split(" :: ")
            if len(fields) < 6:
                raise SystemExit(f"{EQUIVALENT_FILE}: an entry needs 5 id fields and a reason: {line!r}")
            named[" :: ".join(fields[:5])] = " :: ".join(fields[5:])
    return named


# --- The tree, the build, the module -------------------------------------------------------------------

def sync_tree():
    """Copies each synced file of the work tree into build/mutation/tree when its content differs, and
    removes files the work tree no longer has (build outputs and caches aside)."""
    wanted = set()
    for entry in SYNCED:
        source = os.path.join(ROOT, entry)
        if os.path.isfile(source):
            wanted.add(entry)
            continue
        for folder, dirs, names in os.walk(source):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", ".hypothesis", "build")]
            for name in names:
                if name.endswith((".so", ".pyc", ".o")):
                    continue
                wanted.add(os.path.relpath(os.path.join(folder, name), ROOT))
    for relative in sorted(wanted):
        source = os.path.join(ROOT, relative)
        target = os.path.join(TREE, relative)
        if os.path.exists(target) and open(source, "rb").read() == open(target, "rb").read():
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        # copyfile, not copy2: the copy must be newer than what was built from the text it replaces. A run
        # stopped mid-mutant (killed, out of time) leaves the mutant and its objects behind; copy2 would give the
        # restored file the work tree's older mtime, Ninja would keep the mutant's objects, and the next run's
        # "unmutated" module would be that mutant.
        shutil.copyfile(source, target)
    for entry in SYNCED:
        for folder, dirs, names in os.walk(os.path.join(TREE, entry)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", ".hypothesis")]
            for name in names:
                relative = os.path.relpath(os.path.join(folder, name), TREE)
                if relative not in wanted and not name.endswith((".pyc", ".so")):
                    os.remove(os.path.join(folder, name))


def snapshot_sources():
    """The C sources of the mutation tree, as synced (what every mutant is restored to)."""
    sources = {}
    for folder in ("csrc", "include/cai_dlpack"):
        for name in sorted(os.listdir(os.path.join(TREE, folder))):
            path = os.path.join(TREE, folder, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    sources[path] = f.read()
    return sources


def check_tree_clean(sources):
    """The mutation tree's C sources are as synced: a mutant was restored (a run killed hard mid-mutant is
    repaired by the next start's sync_tree; this proves it)."""
    for path, content in sources.items():
        with open(path, "rb") as f:
            if f.read() != content:
                raise SystemExit(f"{path} is not as synced: a mutant was not restored")


def configure():
    if os.path.exists(os.path.join(CMAKE_DIR, "build.ninja")) and \
            os.path.exists(os.path.join(CMAKE_DIR, "compile_commands.json")):
        return
    subprocess.run(["cmake", "-S", TREE, "-B", CMAKE_DIR, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DCAI_DLPACK_WERROR=ON", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                    f"-DPython_EXECUTABLE={sys.executable}"],
                   check=True, stdout=subprocess.DEVNULL)


def compiled_lines():
    """{source path: the line numbers this build compiles}: each C file of the module preprocessed with its own
    compile command (CMake's compile_commands.json), the lines the preprocessor kept read from its line markers;
    a header's lines are those any file kept. A line outside them sits in a branch this interpreter's build
    leaves out (#if for CPython 3.12+, the free-threaded build, another toolchain): no mutant of it can be
    tested here."""
    with open(os.path.join(CMAKE_DIR, "compile_commands.json")) as f:
        commands = json.load(f)
    kept = {}
    for entry in commands:
        if not entry["file"].endswith(".c"):
            continue
        words = shlex.split(entry["command"])
        if "-o" in words:
            at = words.index("-o")
            del words[at:at + 2]
        # (-fdirectives-only: #if is evaluated, no macro expanded, so a macro call over several lines keeps them all)
        words = [w for w in words if w != "-c"] + ["-E", "-fdirectives-only"]
        out = subprocess.run(words, cwd=entry["directory"], capture_output=True, text=True, check=True).stdout
        current, line = None, 0
        for text in out.splitlines():
            marker = re.match(r'# (\d+) "(.*)"', text)
            if marker:
                line, current = int(marker.group(1)), os.path.realpath(marker.group(2))
                continue
            if current is not None and text.strip():
                kept.setdefault(current, set()).add(line)
            line += 1
    return kept


def build(timeout):
    """Builds the module; returns (ok, path of the .so, compiler output)."""
    run = subprocess.run(["nice", "cmake", "--build", CMAKE_DIR, "--target", "_core"], capture_output=True,
                         text=True, timeout=timeout)
    built = [n for n in os.listdir(CMAKE_DIR) if n.startswith("_core") and n.endswith(".so")]
    if run.returncode != 0 or len(built) != 1:
        return False, None, run.stdout + run.stderr
    return True, os.path.join(CMAKE_DIR, built[0]), run.stdout


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def install(module_path, where=None):
    """Lays out build/mutation/pkg/cai_dlpack (or where/cai_dlpack): the Python package, the headers, and the
    module just built. Returns the installed module's path."""
    package = os.path.join(where or PKG, "cai_dlpack")
    if os.path.exists(package):
        shutil.rmtree(package)
    shutil.copytree(os.path.join(TREE, "python", "cai_dlpack"), package,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    os.makedirs(os.path.join(package, "include", "cai_dlpack"))
    for header in ("cai_dlpack.h", "dlpack_abi.h"):
        shutil.copy2(os.path.join(TREE, "include", "cai_dlpack", header),
                     os.path.join(package, "include", "cai_dlpack", header))
    target = os.path.join(package, os.path.basename(module_path))
    shutil.copy2(module_path, target)
    return target


def pytest_env(module_path):
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(module_path))
    env["PYTHONPATH"] = os.pathsep.join([package_root, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["CDL_MUTANT_MODULE"] = module_path
    env["CDL_MUTANT_SHA256"] = sha256(module_path)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


GUARD_FAILED = 97  # guard_plugin.py's exit status: the imported module is not the one built


def run_pytest(tests, module_path, timeout, deselect, stop_first=True, extra=()):
    """(outcome, summary): outcome 'pass', 'fail', 'timeout', 'guard'."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "guard_plugin",
               "-o", "addopts=", "--tb=line", "-rfE"]
    command += ["-x"] if stop_first else []
    for test in deselect:
        command += ["--deselect", test]
    command += list(extra) + list(tests)
    # A session of its own, so that a hang is ended with everything it started (mpiexec, subprocesses).
    process = subprocess.Popen(["nice"] + command, cwd=TREE, env=pytest_env(module_path), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return "timeout", (output or "")[-2000:]
    except BaseException:
        # The runner stopped (Ctrl-C, SIGTERM): the tests it started stop with it, not run on as orphans.
        os.killpg(process.pid, signal.SIGKILL)
        raise
    if process.returncode == GUARD_FAILED:
        return "guard", output[-2000:]
    if process.returncode == 0:
        return "pass", ""
    if process.returncode < 0:
        return "fail", f"pytest died by signal {-process.returncode} (a crash)"
    # The test that failed, whatever the exit status: a plugin's error while reporting a failure (exit status 3,
    # INTERNALERROR) still names it, and it is what the unmutated module is asked about.
    failed = [re.match(r"\S+ (.+?)(?: - .*)?$", line).group(1) for line in output.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    tests_failed = [test for test in failed if is_test_id(test)]
    if tests_failed:
        return "fail", tests_failed[0]
    if process.returncode in (1, 2):
        return "fail", (failed[0] if failed else output.strip().splitlines()[-1] if output.strip() else "")
    return "fail", f"pytest exit status {process.returncode}: " + output[-600:]


class Baseline:
    """The unmutated module (build/mutation/baseline) and the tests known to pass or fail on it. A mutant's
    kill counts only when the test that failed passes on the unmutated module; a test that fails there too is
    deselected from then on (listed in the report) and the mutant is run again. A failure that names no test
    (a crash, a hang, an error of pytest or a plugin, a file that does not collect) counts only when the unmutated
    module gets through the same tests, in the same time limit."""

    def __init__(self, module_path, timeout):
        self.module = module_path
        self.timeout = timeout
        self.verdicts = {}
        self.selections = {}

    def runs_clean(self, tests, timeout):
        """(clean, detail): whether the unmutated module passes tests (the same selection, the same deselected
        tests, the same limit), asked once per selection. A test failing there is deselected from then on."""
        key = (tuple(tests), tuple(self.failing), timeout)
        if key not in self.selections:
            outcome, detail = run_pytest(tests, self.module, timeout, self.failing)
            if outcome == "guard":
                raise SystemExit("the guard refused the unmutated module")
            if outcome == "fail" and is_test_id(detail):
                self.verdicts[detail] = False
            self.selections[key] = (outcome == "pass", detail if outcome == "fail" else
                                    "no result within the time limit" if outcome == "timeout" else "")
        return self.selections[key]

    def passes(self, test_id):
        if test_id not in self.verdicts:
            outcome, _ = run_pytest([test_id], self.module, self.timeout, [])
            if outcome == "guard":
                raise SystemExit("the guard refused the unmutated module")
            self.verdicts[test_id] = outcome == "pass"
        return self.verdicts[test_id]

    @property
    def failing(self):
        return sorted(t for t, ok in self.verdicts.items() if not ok)


# --- One mutant ------------------------------------------------------------------------------------------

def apply(site):
    with open(site.path) as f:
        lines = f.readlines()
    if lines[site.first:site.last + 1] != site.original:
        raise SystemExit(f"{site.path}:{site.first + 1} is not what was sampled (the tree changed?)")
    lines[site.first:site.last + 1] = site.replacement
    with open(site.path, "w") as f:
        f.writelines(lines)


def restore(site, original_text):
    with open(site.path, "w") as f:
        f.write(original_text)


def is_test_id(text):
    return text.startswith("tests/") and "::" in text


# compiled_lines() of the unmutated tree, read once a run starts.
COMPILED = {}


def unconfirmed_detail(unconfirmed):
    """Why a mutant whose only failing tests failed among others, never alone, is inconclusive."""
    return (f"{', '.join(unconfirmed)} failed with the others but passed alone on the mutant too (flaky, or hanging "
            "on an earlier test)")


def run_mutant(site, baseline_hash, args, baseline, named_equivalent):
    result = site.describe()
    started = time.monotonic()
    kept = COMPILED.get(os.path.realpath(site.path), set())
    if not any(line in kept for line in range(site.first + 1, site.last + 2)):
        result["status"] = "not built here"
        result["detail"] = (f"the line is in a branch this build leaves out (Python {sys.version.split()[0]}): "
                            "run the mutation with an interpreter whose build compiles it")
        return result
    with open(site.path) as f:
        original_text = f.read()
    try:
        apply(site)
        try:
            ok, module, output = build(args.build_timeout)
        except subprocess.TimeoutExpired:
            ok, module, output = False, None, "build timed out"
        if not ok:
            result["status"] = "did not compile"
            errors = [line for line in output.splitlines() if "error:" in line]
            result["detail"] = errors[0] if errors else output[-300:]
            return result
        built_hash = sha256(module)
        installed = install(module)
        if sha256(installed) != built_hash:
            raise SystemExit("the installed module is not the one built")
    finally:
        restore(site, original_text)
    if built_hash == baseline_hash:
        result["status"] = "equivalent"
        result["detail"] = "the built module is byte for byte the unmutated one"
        return result
    if site.stable_id in named_equivalent:
        result["status"] = "equivalent"
        result["detail"] = named_equivalent[site.stable_id]
        return result
    related = [os.path.join("tests", "cpu", t) for t in RELATED_TESTS.get(site.file, [])]
    suite = ["tests/cpu"] + [arg for t in SUITE_EXCLUDED for arg in ("--ignore", os.path.join("tests", "cpu", t))]
    stages = [(stage, tests, timeout) for stage, tests, timeout in
              (("related tests", related, args.test_timeout), ("whole CPU suite", suite, args.suite_timeout))
              if tests and not (stage == "whole CPU suite" and args.no_suite)]
    unconfirmed = []  # tests that failed with the others but passed alone on the mutant: left out, and go on
    outcome, detail = "pass", ""
    for number, (stage, tests, timeout) in enumerate(stages, start=1):
        result["stage"] = stage
        while True:
            outcome, detail = run_pytest(tests, installed, timeout, baseline.failing + unconfirmed)
            if outcome == "pass" and unconfirmed and number == len(stages):
                # (at an earlier stage a pass goes on to the next, with those tests still left out)
                outcome, detail = "inconclusive", unconfirmed_detail(unconfirmed) + ", and no other test fails"
            if outcome in ("pass", "guard", "inconclusive"):
                break
            # A kill counts when the failing test passes on the unmutated module, and fails again on the mutant
            # when run alone: a test that failed only in the company of others (flaky under load, or hanging on
            # what an earlier test left) proves nothing about this mutant; it is left out and the tests after it
            # run (three such tests at most: then the mutant is inconclusive).
            if is_test_id(detail):
                if baseline.passes(detail):
                    again, _ = run_pytest([detail], installed, args.test_timeout, [])
                    if again == "pass":
                        unconfirmed.append(detail)
                        if len(unconfirmed) < 3:
                            continue
                        outcome, detail = "inconclusive", unconfirmed_detail(unconfirmed)
                    break
                continue
            # Nothing names a test (a crash, a hang, a plugin's or the collection's error): a kill counts when the
            # unmutated module gets through the same tests in the same time.
            deselected = len(baseline.failing)
            clean, why = baseline.runs_clean(tests, timeout)
            if clean:
                break
            if len(baseline.failing) > deselected:
                continue  # a test failing on the unmutated module too is deselected now: the mutant again
            outcome, detail = "inconclusive", f"the unmutated module fails these tests too ({why[:300]}); the mutant: {detail}"
            break
        if outcome != "pass":
            break
    if outcome == "guard":
        raise SystemExit("the guard refused the mutant's module:\n" + detail)
    result["status"] = {"pass": "survived", "fail": "killed", "timeout": "timeout", "inconclusive": "inconclusive"}[outcome]
    result["detail"] = detail if outcome != "timeout" else f"a hang: no result within the time limit ({result['stage']})"
    if outcome == "pass" and args.no_suite:
        result["detail"] = "outlived its file's tests; the whole suite was not run (--no-suite)"
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


# --- The report ------------------------------------------------------------------------------------------

def write_report(path, args, results, deselected, started, elapsed_min=None):
    counts = {s: sum(1 for r in results if r["status"] == s)
              for s in ("killed", "timeout", "survived", "equivalent", "did not compile", "inconclusive",
                        "not built here")}
    changing = counts["killed"] + counts["timeout"] + counts["survived"]
    killed = counts["killed"] + counts["timeout"]
    score = f"{killed} of {changing} ({100.0 * killed / changing:.1f}%)" if changing else "n/a"
    command = "python tests/mutation/run.py --seed {} --count {}".format(args.seed, args.count)
    if args.files:
        command += " --files " + " ".join(args.files)
    for option in ("range", "indices", "ids"):
        if getattr(args, option, None):
            command += f" --{option} {getattr(args, option)}"
    if getattr(args, "no_suite", False):
        command += " --no-suite"
    lines = [
        "# Mutation run report",
        "",
        f"- command: `{command}`",
        f"- seed: {args.seed}; mutants sampled: {len(results)} of {args.count} asked" if not getattr(args, "ids", None)
        else f"- mutants: {len(results)}, the ones the ids of {args.ids} name (not a sample)",
        f"- sources: csrc at commit {args.sources} (when the run started)",
        f"- started {started}, took {elapsed_min if elapsed_min is not None else round((time.monotonic() - args.t0) / 60, 1)} min",
        f"- **score: behaviour-changing mutants killed: {score}** (a timeout, a hang, counts as killed)",
        "",
        "| status | count |",
        "|---|---|",
    ] + [f"| {k} | {v} |" for k, v in counts.items()] + [""]
    lines += ["Left out of the whole-suite stage (build, packaging, typing, benchmark scripts): "
              + ", ".join(f"`{t}`" for t in SUITE_EXCLUDED) + ".", ""]
    if deselected:
        lines += ["Tests deselected (a mutant's failing test that fails on the unmutated module too):", ""]
        lines += [f"- `{t}`" for t in deselected] + [""]
    for title, status in (("Survivors", "survived"), ("Equivalent mutants", "equivalent"),
                          ("Hangs (counted as killed)", "timeout"), ("Did not compile", "did not compile"),
                          ("Inconclusive: the unmutated module fails the same tests (not counted)", "inconclusive"),
                          ("Not built here: a branch this interpreter's build leaves out (not counted)",
                           "not built here"),
                          ("Killed", "killed")):
        chosen = [r for r in results if r["status"] == status]
        if not chosen:
            continue
        lines += [f"## {title} ({len(chosen)})", ""]
        for r in chosen:
            lines.append(f"- `{r['file']}:{r['line']}` ({r['function']}, {r['operator']})"
                         + (f": {r['detail']}" if r.get("detail") else ""))
            if status != "killed":
                lines += ["  ```diff"] + [f"  - {l}" for l in r["original"].splitlines()] + \
                         [f"  + {l}" for l in r["mutated"].splitlines()] + ["  ```",
                                                                             f"  id: `{r['id']}`"]
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump({"seed": args.seed, "count": args.count, "files": args.files, "results": results,
                   "deselected": deselected, "score": score, "started": started, "sources": args.sources,
                   "elapsed_min": elapsed_min if elapsed_min is not None else
                   round((time.monotonic() - args.t0) / 60, 1)}, f, indent=1)


def merge(args):
    """One report of a run made in ranges: the results by their index (a result without one is at its place
    in its report; of two results for one index, the one of the report named later, a rerun, is kept), the
    deselected tests of all, the longest time."""
    results, deselected, started, elapsed, sources = {}, set(), [], 0.0, []
    for path in args.merge:
        with open(path) as f:
            part = json.load(f)
        if (part["seed"], part["count"]) != (args.seed, args.count):
            raise SystemExit(f"{path} is of seed {part['seed']}, count {part['count']}")
        for position, result in enumerate(part["results"]):
            index = result.get("index", position)
            # An index names a mutant only for one csrc/: a rerun made after csrc/ changed may name another.
            if index in results and results[index]["id"] != result["id"]:
                raise SystemExit(f"{path}: sampled mutant {index} is {result['id']!r} there but "
                                 f"{results[index]['id']!r} in an earlier part (csrc/ changed between them?)")
            results[index] = result
        deselected.update(part["deselected"])
        started.append(part.get("started", ""))
        elapsed = max(elapsed, part.get("elapsed_min", 0.0))
        if part.get("sources", "unknown") not in sources:
            sources.append(part.get("sources", "unknown"))
    args.sources = ", ".join(sources)  # the commit each part started at (one, unless a rerun came later)
    ordered = [results[i] for i in sorted(results)]
    named = read_equivalents()  # survivors named equivalent since their run
    for result in ordered:
        if result["status"] == "survived" and result["id"] in named:
            result["status"], result["detail"] = "equivalent", named[result["id"]]
    write_report(args.report, args, ordered, sorted(deselected), min(started), elapsed)


def git_head():
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def git_clean():
    return not subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "csrc"], capture_output=True,
                              text=True).stdout.strip()


def main():
    # SIGTERM ends the run as Ctrl-C does: the tests it started are killed and the mutated file restored (the
    # `finally`s run), where the default action would leave both behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--files", nargs="*", help="csrc files to mutate (default: csrc/*.c and cdl_internal.h)")
    parser.add_argument("--report", default=os.path.join(WORK, "report.md"))
    parser.add_argument("--list", action="store_true", help="print the sampled mutants and stop")
    parser.add_argument("--range", default=None, help="A:B: run only the sampled mutants A..B-1 (runs side by side, "
                        "each with its own --workdir, then --merge)")
    parser.add_argument("--indices", default=None, help="I,J,...: run only these sampled mutants (0-based), e.g. "
                        "a report's survivors again once tests were added")
    parser.add_argument("--ids", default=None, help="a file of mutant ids, one a line (as a report prints them): run "
                        "those mutants wherever they are now, sampled or not (indices change when csrc/ does); an id "
                        "from before the #k suffix runs every place it names; the report is its own, not a part to --merge")
    parser.add_argument("--workdir", default=WORK, help="the folder of the tree, build and packages")
    parser.add_argument("--merge", nargs="*", default=None, help="JSON reports of the ranges of one run: writes "
                        "their combined report to --report and stops (a mutant in two of them: the later one's result)")
    parser.add_argument("--no-suite", action="store_true", help="a first pass: a mutant that outlives its file's "
                        "tests is reported as a survivor without the whole suite (run again by --ids once a test "
                        "is written, or without this flag to confirm it)")
    parser.add_argument("--build-timeout", type=int, default=300)
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds for a mutant's related tests")
    parser.add_argument("--suite-timeout", type=int, default=900, help="seconds for the whole CPU suite")
    args = parser.parse_args()
    args.t0 = time.monotonic()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # The commit the work tree is at now, when its files are synced: a report written an hour later names the
    # code its mutants were drawn from, not what was committed meanwhile.
    args.sources = f"{git_head()} (work tree {'clean' if git_clean() else 'with changes'})"
    if args.merge is not None:
        merge(args)
        return
    set_workdir(args.workdir)

    if args.files:
        files = [os.path.join(ROOT, f) if not os.path.isabs(f) else f for f in args.files]
    else:
        csrc = os.path.join(ROOT, "csrc")
        files = sorted(os.path.join(csrc, n) for n in os.listdir(csrc) if n.endswith(".c"))
        files.append(os.path.join(csrc, "cdl_internal.h"))
    # Sites are read from the work tree, mutated in the copy: the same text.
    os.makedirs(WORK, exist_ok=True)
    lock = open(os.path.join(WORK, "lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit("another mutation run holds build/mutation (build/mutation/lock)")
    sync_tree()
    sources = snapshot_sources()
    for path in sources:
        relative = os.path.relpath(path, TREE)
        with open(os.path.join(ROOT, relative), "rb") as f:
            if f.read() != sources[path]:
                raise SystemExit(f"the mutation tree's {relative} differs from the work tree's after the sync")
    # Every source newer than every object: the unmutated module is built from these sources, whatever a run
    # stopped mid-mutant (before sync_tree wrote fresh times, or by the runner of before) left in the build.
    now = time.time()
    for path in sources:
        os.utime(path, (now, now))
    tree_files = [os.path.join(TREE, os.path.relpath(f, ROOT)) for f in files]
    sites = sample_sites(tree_files, args.seed, args.count)
    every_site = [site for path in tree_files for site in sites_of(path)[0]]
    if args.ids:
        with open(args.ids) as f:
            wanted = [line.strip().strip("`") for line in f if line.strip() and not line.lstrip().startswith("#")]
        named = [i for i in wanted if not any(i in (site.stable_id, site.base_id) for site in every_site)]
        if named:
            raise SystemExit("no site of " + " ".join(os.path.relpath(f, ROOT) for f in files) + " has the id:\n" +
                             "\n".join(named))
        sites = [site for site in every_site if site.stable_id in wanted or site.base_id in wanted]
    first, last = 0, len(sites)
    chosen = None if args.indices is None else {int(i) for i in args.indices.split(",")}
    if args.range:
        first, last = (int(x) for x in args.range.split(":"))
    if args.list:
        for s in sites:
            d = s.describe()
            print(f"{d['file']}:{d['line']} {d['operator']}: {d['original'].strip()!r} -> {d['mutated'].strip()!r}")
        return
    named_equivalent = read_equivalents()
    if not args.files:
        known = {site.stable_id for site in every_site}
        for stale in sorted(set(named_equivalent) - known):
            print(f"equivalent.txt names no site of csrc/ (its line changed, or it names a place that is one of "
                  f"several without its #k): {stale}", flush=True)
    configure()
    COMPILED.update(compiled_lines())
    ok, module, output = build(args.build_timeout)
    if not ok:
        raise SystemExit("the unmutated tree does not build:\n" + output)
    baseline_hash = sha256(module)
    baseline = Baseline(install(module, BASELINE_PKG), args.test_timeout)
    print(f"baseline module {baseline_hash[:12]}", flush=True)
    results = []
    try:
        for number, site in enumerate(sites, 1):
            if not first < number <= last or (chosen is not None and number - 1 not in chosen):
                continue
            result = run_mutant(site, baseline_hash, args, baseline, named_equivalent)
            result["index"] = number - 1
            results.append(result)
            print(f"[{number}/{len(sites)}] {result['status']:15} {result['file']}:{result['line']} "
                  f"{result['operator']}: {result['original'].strip()[:60]!r} -> "
                  f"{result['mutated'].strip()[:60]!r}  {result.get('detail', '')[:120]}", flush=True)
            write_report(args.report, args, results, baseline.failing, started)
    finally:
        check_tree_clean(sources)
        # Leave the installed module unmutated.
        ok, module, _ = build(args.build_timeout)
        if ok:
            install(module)
    write_report(args.report, args, results, baseline.failing, started)
    print(f"report: {args.report}")


if __name__ == "__main__":
    main()
