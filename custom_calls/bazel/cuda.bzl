"""nvcc_shared_library: one shared library from .cu sources, compiled and linked by nvcc in one action.

No rules_cuda (it would be downloaded): the action runs the nvcc found by local_deps.bzl with the
flags of CMakeLists.txt (-O2, C++17, -fvisibility=hidden, static cudart, the exports version script).
"""

load("@local_build_deps//:defs.bzl", "NVCC")

CudaArchsInfo = provider(doc = "CUDA architectures, e.g. ['90a', '100a']", fields = ["archs"])

def _cuda_archs_impl(ctx):
    archs = [a.strip() for a in ctx.build_setting_value.replace(",", ";").split(";") if a.strip()]
    if not archs:
        fail("cuda_archs is empty")
    return [CudaArchsInfo(archs = archs)]

cuda_archs = rule(
    implementation = _cuda_archs_impl,
    build_setting = config.string(flag = True),
)

def _nvcc_shared_library_impl(ctx):
    out = ctx.actions.declare_file(ctx.attr.out)
    gencode = ["--generate-code=arch=compute_{a},code=[compute_{a},sm_{a}]".format(a = a) for a in ctx.attr.archs[CudaArchsInfo].archs]
    headers = ctx.files.ffi_headers
    include = headers[0].path.split("/xla/ffi/api/")[0]
    srcs = [f.path for f in ctx.files.srcs]
    hdr_dirs = {f.dirname: True for f in ctx.files.hdrs}.keys()
    args = [NVCC, "-O2", "-std=c++17", "-shared", "-cudart", "static", "-Xcompiler=-fPIC,-fvisibility=hidden"]
    args += gencode + ["-isystem", include] + ["-I" + d for d in hdr_dirs]
    args += ["-Xlinker", "--version-script=" + ctx.file.version_script.path, "-o", out.path] + srcs
    ctx.actions.run_shell(
        inputs = ctx.files.srcs + ctx.files.hdrs + headers + [ctx.file.version_script],
        outputs = [out],
        command = " ".join(["'%s'" % a for a in args]),
        use_default_shell_env = True,
        mnemonic = "Nvcc",
        progress_message = "nvcc %s" % out.short_path,
    )
    return [DefaultInfo(files = depset([out]))]

nvcc_shared_library = rule(
    implementation = _nvcc_shared_library_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = [".h"]),
        "archs": attr.label(providers = [CudaArchsInfo]),
        "ffi_headers": attr.label(allow_files = True),
        "out": attr.string(mandatory = True),
        "version_script": attr.label(allow_single_file = True),
    },
)
