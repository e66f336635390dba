"""Finds LibTorch on the machine and exposes it as @local_config_torch//:torch.

Environment:
  LIBTORCH  Root of an unpacked LibTorch zip (holding include/ and lib/). When unset, the
            `torch` Python wheel is located through `PYTHON` (default: python3).
  PYTHON    Interpreter whose `torch` package provides LibTorch. Default: python3.

The C++ ABI (_GLIBCXX_USE_CXX11_ABI) is read from the installation, not assumed, and so are
the macros LibTorch's own CMake targets give their users (torch_cpu's USE_DISTRIBUTED,
USE_C10D_GLOO, ...; torch_cuda's USE_C10D_NCCL, ...): c10d's headers declare ProcessGroupNCCL
only under USE_C10D_NCCL, so the Bazel build must define exactly what CMake's does
(tools/check_build_parity.py compares the two in CI).
"""

_ENV = ["LIBTORCH", "PYTHON"]

def _fail(msg):
    fail("\n[torch_configure] " + msg + "\n")

def _abi_from_cmake(ctx, root):
    for rel in ["share/cmake/Torch/TorchConfig.cmake", "share/cmake/Caffe2/Caffe2Targets.cmake"]:
        path = ctx.path(str(root) + "/" + rel)
        if path.exists:
            text = ctx.read(path)
            for value in ["1", "0"]:
                if "_GLIBCXX_USE_CXX11_ABI=" + value in text:
                    return value
    return None

def _interface_definitions(text, target):
    """The literal INTERFACE_COMPILE_DEFINITIONS of imported `target` in Caffe2Targets.cmake."""
    start = text.find("add_library(%s SHARED IMPORTED)" % target)
    if start < 0:
        return []
    block = text[start:text.find("\n)\n", start)]
    marker = "INTERFACE_COMPILE_DEFINITIONS \""
    at = block.find(marker)
    if at < 0:
        return []
    value = block[at + len(marker):]
    value = value[:value.find("\"")]
    return [d for d in value.split(";") if d and not d.startswith("$") and not d.startswith("\\$")]

def _torch_definitions(ctx, root, has_cuda):
    path = ctx.path(str(root) + "/share/cmake/Caffe2/Caffe2Targets.cmake")
    if not path.exists:
        _fail("%s is missing: cannot tell which macros LibTorch's users must define (USE_C10D_NCCL, ...)." % path)
    text = ctx.read(path)
    defines = []
    for target in ["torch_cpu"] + (["torch_cuda"] if has_cuda else []):
        for d in _interface_definitions(text, target):
            if d not in defines:
                defines.append(d)
    return defines

def _torch_configure_impl(ctx):
    libtorch = ctx.os.environ.get("LIBTORCH", "")
    python = ctx.os.environ.get("PYTHON", "python3")
    abi = None
    if libtorch:
        root = ctx.path(libtorch)
        if not root.get_child("include").exists or not root.get_child("lib").exists:
            _fail("LIBTORCH=%s does not hold include/ and lib/; point it at an unpacked LibTorch zip." % libtorch)
        abi = _abi_from_cmake(ctx, root)
    else:
        res = ctx.execute([python, "-c", "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"])
        if res.return_code != 0:
            _fail("could not import torch with %s (%s). Install the pinned wheel (./bazelw does) or set LIBTORCH=/path/to/libtorch." % (python, res.stderr.strip()))
        lines = res.stdout.strip().split("\n")
        root = ctx.path(lines[-3])
        abi = lines[-2]
    if abi == None:
        abi = "1"
    lib = root.get_child("lib")
    has_cuda = lib.get_child("libtorch_cuda.so").exists
    ctx.symlink(root.get_child("include"), "include")
    ctx.symlink(lib, "lib")
    defines = ["_GLIBCXX_USE_CXX11_ABI=" + abi] + _torch_definitions(ctx, root, has_cuda)
    ctx.template("BUILD", ctx.attr._build_tpl, {
        "%{defines}": repr(defines),
        "%{libdir}": str(lib.realpath),
        "%{has_cuda}": "True" if has_cuda else "False",
    })
    ctx.file("defs.bzl", "TORCH_HAS_CUDA = %s\n" % ("True" if has_cuda else "False"))

torch_configure = repository_rule(
    implementation = _torch_configure_impl,
    attrs = {"_build_tpl": attr.label(default = Label("//third_party/torch:BUILD.tpl"))},
    environ = _ENV,
    local = True,
)
