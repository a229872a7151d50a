"""A local repository with nvcc's path and the installed jax's XLA FFI headers (nothing downloaded).

nvcc: $NVCC, else $CUDA_PATH/bin/nvcc, else `nvcc` on PATH. Python: $PYTHON_BIN_PATH, else `python3`
on PATH; it must import jax (its jax.ffi.include_dir() is symlinked as include/).
"""

def _find_nvcc(rctx):
    if rctx.os.environ.get("NVCC"):
        return rctx.os.environ["NVCC"]
    cuda = rctx.os.environ.get("CUDA_PATH")
    if cuda and rctx.path(cuda + "/bin/nvcc").exists:
        return cuda + "/bin/nvcc"
    nvcc = rctx.which("nvcc")
    if nvcc == None:
        fail("nvcc not found: put it on PATH or set NVCC / CUDA_PATH")
    return str(nvcc)

def _local_build_deps_impl(rctx):
    python = rctx.os.environ.get("PYTHON_BIN_PATH") or rctx.which("python3")
    if python == None:
        fail("python3 not found: set PYTHON_BIN_PATH to an interpreter that imports jax")
    res = rctx.execute([str(python), "-c", "import jax; print(jax.ffi.include_dir())"])
    if res.return_code != 0:
        fail("cannot import jax with %s (set PYTHON_BIN_PATH):\n%s" % (python, res.stderr))
    rctx.symlink(res.stdout.strip(), "include")
    rctx.file("defs.bzl", "NVCC = %r\n" % _find_nvcc(rctx))
    rctx.file("BUILD", """
filegroup(
    name = "xla_ffi_headers",
    srcs = glob(["include/xla/ffi/api/*.h"]),
    visibility = ["//visibility:public"],
)
exports_files(["defs.bzl"])
""")

local_build_deps = repository_rule(
    implementation = _local_build_deps_impl,
    environ = ["NVCC", "CUDA_PATH", "PATH", "PYTHON_BIN_PATH"],
    local = True,
)
