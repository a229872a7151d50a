"""rules_java's setup macros as no-ops: the Bazel 4.2.3 embedded JDK serves, nothing is fetched."""

def rules_java_dependencies():
    pass

def rules_java_toolchains():
    pass
