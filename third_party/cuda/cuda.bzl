"""cuda_library: compiles .cu files with the toolkit's nvcc into objects a cc_library links.

rules_cuda needs a newer Bazel than Debian's 4.2.3, so this is a genrule per file. The .cu
files must not include LibTorch headers: they see raw pointers and cudaStream_t only.
"""

load("@local_config_cuda//:defs.bzl", "CUDA_ENABLED", "NVCC")
load("@local_config_torch//:defs.bzl", "TORCH_HAS_CUDA")
load("//bazel:copts.bzl", "AMP8_COPTS", "AMP8_NVCC_FLAGS")

# CUDA code is built when both a toolkit and a CUDA build of LibTorch are present.
AMP8_CUDA = CUDA_ENABLED and TORCH_HAS_CUDA

def if_amp8_cuda(if_true, if_false = []):
    return if_true if AMP8_CUDA else if_false

def cuda_library(name, srcs, hdrs = [], deps = [], **kwargs):
    """A cc_library holding nvcc-compiled objects of `srcs` (empty in CPU-only builds)."""
    objs = []
    if AMP8_CUDA:
        for src in srcs:
            obj = name + "_" + src.replace("/", "_").replace(".cu", ".o")
            native.genrule(
                name = obj + "_nvcc",
                srcs = [src] + hdrs,
                outs = [obj],
                cmd = "%s %s -I. -I$(GENDIR) -c $(location %s) -o $@" % (
                    NVCC,
                    " ".join(AMP8_NVCC_FLAGS),
                    src,
                ),
                message = "nvcc " + src,
            )
            objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        copts = AMP8_COPTS,
        deps = deps + (["@local_config_cuda//:cudart"] if AMP8_CUDA else []),
        **kwargs
    )
