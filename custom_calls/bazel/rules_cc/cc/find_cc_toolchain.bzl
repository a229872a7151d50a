"""rules_cc's toolchain lookup, forwarding to @bazel_tools."""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

def find_cc_toolchain(ctx):
    return find_cpp_toolchain(ctx)
