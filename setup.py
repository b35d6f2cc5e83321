"""The compiled tile kernel (edgetrain/models/_tile_kernel.c; edgetrain/models/tile_kernel.py says what it does).

Everything else about the package is in pyproject.toml. The kernel is plain C against Python's headers, built
where edgetrain is installed, in up to two tries:

1. with OpenMP, so a tile's rows are shared between the threads torch computes with. It links libgomp.so.1,
   the soname torch's own OpenMP runtime has (torch/lib/libgomp.so.1): loaded after torch, the kernel finds
   that library already in the process and uses its thread pool, so no second pool competes with torch's.
   (A wheel repaired by auditwheel would carry its own libgomp under another soname, and with it a second thread
   pool beside torch's: build from source, as edgetrain's install does.)
2. without it (a compiler with no OpenMP: Apple's clang), one thread.

Optional: where neither builds (no C compiler) the install goes on without the kernel and torch's kernels
dequantise, with the same numbers. -ffp-contract=off: no fused multiply-adds, so the kernel's float32
arithmetic rounds as torch's separate kernels do.
"""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.errors import CCompilerError, CompileError, LinkError
except ImportError:  # setuptools < 59
    from distutils.errors import CCompilerError, CompileError, LinkError

ARITHMETIC_FLAGS = ["-O3", "-ffp-contract=off"]
OPENMP_FLAGS = ["-fopenmp"]


class BuildTileKernel(build_ext):
    def build_extension(self, extension: Extension) -> None:
        try:
            super().build_extension(extension)
            return
        except (CCompilerError, CompileError, LinkError) as error:
            if OPENMP_FLAGS[0] not in extension.extra_compile_args:
                raise
            print(f"edgetrain: the tile kernel does not build with OpenMP here ({error}); building it for one thread")
        extension.extra_compile_args = [flag for flag in extension.extra_compile_args if flag not in OPENMP_FLAGS]
        extension.extra_link_args = [flag for flag in extension.extra_link_args if flag not in OPENMP_FLAGS]
        super().build_extension(extension)


setup(ext_modules=[Extension("edgetrain.models._tile_kernel", sources=["edgetrain/models/_tile_kernel.c"],
                             extra_compile_args=ARITHMETIC_FLAGS + OPENMP_FLAGS, extra_link_args=OPENMP_FLAGS,
                             optional=True)],
      cmdclass={"build_ext": BuildTileKernel})
