#!/usr/bin/env python3
"""Checks that the Bazel and CMake builds are the same build: the same C++ sources compiled into
the same targets, the same test executables, and the same preprocessor macros on every amp8
source. A Bazel cc_library //pkg:name is CMake's amp8_<name> (//ops:ops is amp8_ops,
//recipes:precision amp8_precision); binaries and tests keep their names.

Usage: check_build_parity.py CMAKE_BUILD_DIR   (configured with CMAKE_EXPORT_COMPILE_COMMANDS=ON;
       runs `./bazelw aquery` / `query`, which analyse the Bazel build without compiling)

Both builds once differed silently: Bazel compiled plugin/distributed/process_group.cc without LibTorch's
USE_C10D_NCCL (CMake takes it from torch's targets), so a Bazel-built gpt_pretrain had no NCCL.
Exits 1, naming each difference.
"""
import json
import pathlib
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Build-type and toolchain macros that legitimately differ: CMake's Release adds NDEBUG; Bazel's
# toolchain adds _FORTIFY_SOURCE and redacts __DATE__ / __TIME__ / __TIMESTAMP__; CMake's GTest
# target adds GTEST_HAS_PTHREAD=1 (what GoogleTest detects by itself); _GLIBCXX_USE_CXX11_ABI=1
# is GCC's default, which LibTorch's CMake config leaves implicit (=0 would be a real difference).
IGNORED_MACROS = {"NDEBUG", "_FORTIFY_SOURCE", "GTEST_HAS_PTHREAD"}
IGNORED_DEFINITIONS = {"_GLIBCXX_USE_CXX11_ABI=1"}
# Built by CMake only: the find_package consumer and the clang-built fuzzers have their own
# projects; the GPU benchmarks are CMake-only where Bazel has no CUDA (AMP8_CPU_ONLY).
CMAKE_ONLY_PREFIXES = ("examples/consumer/", "fuzz/")


def macros(arguments):
    found = set()
    args = list(arguments)
    for i, arg in enumerate(args):
        value = None
        if arg == "-D" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("-D"):
            value = arg[2:]
        if (value is None or value.startswith("__") or value.split("=")[0] in IGNORED_MACROS
                or value in IGNORED_DEFINITIONS):
            continue
        found.add(value)
    return found


def source_of(arguments, directory):
    for arg in arguments:
        if arg.endswith(".cc") and not arg.startswith("-"):
            path = pathlib.Path(arg)
            if not path.is_absolute():
                path = pathlib.Path(directory) / path
            try:
                return str(path.resolve().relative_to(ROOT))
            except ValueError:
                return None
    return None


def bazel(*args):
    out = subprocess.run([str(ROOT / "bazelw"), *args], cwd=ROOT, check=True, capture_output=True, text=True)
    return out.stdout


def bazel_compiles():
    """{source: (target, macros)} for every C++ compile of amp8's own sources in the Bazel build,
    the target named as CMake names it."""
    text = json.loads(bazel("aquery", 'mnemonic("CppCompile", //...)', "--output=jsonproto"))
    libraries = set(bazel("query", "kind(cc_library, //...)").split())
    labels = {t["id"]: t["label"] for t in text.get("targets", [])}
    compiles = {}
    for action in text.get("actions", []):
        args = action.get("arguments", [])
        src = None
        for i, arg in enumerate(args):
            if arg == "-c" and i + 1 < len(args):
                src = args[i + 1]
        if src and not src.startswith("external/") and src.endswith(".cc"):
            label = labels.get(action.get("targetId"), "?")
            name = label.split(":")[-1]
            compiles[src] = ("amp8_" + name if label in libraries else name, macros(args))
    return compiles


def cmake_target(args):
    """The target of a CMake compile, from its object path (CMakeFiles/<target>.dir/...)."""
    for i, arg in enumerate(args):
        if arg == "-o" and i + 1 < len(args):
            for part in pathlib.PurePath(args[i + 1]).parts:
                if part.endswith(".dir"):
                    return part[: -len(".dir")]
    return "?"


def cmake_compiles(build):
    compiles = {}
    for entry in json.loads((build / "compile_commands.json").read_text()):
        args = entry.get("arguments") or shlex.split(entry["command"])
        # What CMake generates in its build folder (AMP8_PRECOMPILE_TORCH's host source) is not amp8's.
        if (pathlib.Path(entry["directory"]) / entry["file"]).resolve().is_relative_to(build):
            continue
        src = source_of([entry["file"]], entry["directory"])
        if src and src.endswith(".cc") and not src.startswith(CMAKE_ONLY_PREFIXES):
            compiles[src] = (cmake_target(args), macros(args))
    return compiles


def main() -> int:
    build = pathlib.Path(sys.argv[1]).resolve()
    problems = []
    bz, cm = bazel_compiles(), cmake_compiles(build)
    for src in sorted(set(bz) - set(cm)):
        problems.append(f"{src}: compiled by Bazel, not by CMake")
    for src in sorted(set(cm) - set(bz)):
        problems.append(f"{src}: compiled by CMake, not by Bazel")
    for src in sorted(set(bz) & set(cm)):
        (bz_target, bz_macros), (cm_target, cm_macros) = bz[src], cm[src]
        if bz_target != cm_target:
            problems.append(f"{src}: in Bazel's target {bz_target}, in CMake's {cm_target}")
        if bz_macros != cm_macros:
            problems.append(f"{src}: macros only in Bazel {sorted(bz_macros - cm_macros)}, "
                            f"only in CMake {sorted(cm_macros - bz_macros)}")

    bazel_tests = {line.split(":")[-1] for line in bazel("query", "kind(cc_test, //...)").split()}
    # CMake builds one test executable per tests/<unit>_test.cc, named after it.
    cmake_tests = {pathlib.Path(src).stem for src in cm if src.startswith("tests/") and src.endswith("_test.cc")}
    for name in sorted(bazel_tests - cmake_tests):
        problems.append(f"test {name}: in Bazel, not in CMake")
    for name in sorted(cmake_tests - bazel_tests):
        problems.append(f"test {name}: in CMake, not in Bazel")

    for p in problems:
        print("build parity:", p)
    targets = len({target for target, _ in bz.values()})
    print(f"build parity: {len(bz)} sources in {targets} targets and {len(bazel_tests)} test executables compared, "
          f"{len(problems)} difference(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
