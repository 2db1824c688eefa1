"""Build hook for tiercache's one compiled module (everything else is in pyproject.toml).

``tiercache.transfer._copy_runs`` (tiercache/transfer/native/copy_runs.c) is the CPU
copier's plan executor. It is optional: where no C compiler is found the build goes
on without it and the copier keeps its numpy gathers (tiercache/transfer/host_kernel.py
says which one runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tiercache.transfer._copy_runs",
            ["tiercache/transfer/native/copy_runs.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
