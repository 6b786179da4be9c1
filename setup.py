"""Build cydnn: nvcc compiles cpp/*.cu, the objects are linked into one Cython extension (cydnn._C);
the CPU kernels are a second, plain C extension with OpenMP (cydnn.ops.cpu._kernels), which needs
neither CUDA nor a GPU.

    pip install -e .                          # a fresh machine (fetches what it lacks)
    pip install --no-build-isolation -e .     # offline, with the build requirements installed

Environment knobs:
    NVCC, CUDA_HOME, CUDA_PATH   where to find nvcc (see build_tools/cuda_toolchain.py)
    CYDNN_CUDA_ARCHS             e.g. "90" to build one architecture while developing
                                 (default: sm_80 and sm_90 cubins plus compute_90 PTX)
    CYDNN_BUILD_CACHE            the object cache folder (default $XDG_CACHE_HOME/cydnn/build or
                                 ~/.cache/cydnn/build; "off" to compile everything every time):
                                 nvcc objects are reused when the source, the headers, the command
                                 line and the compilers are unchanged (build_tools/object_cache.py)
"""
import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "build_tools"))
import cuda_toolchain  # noqa: E402
import object_cache  # noqa: E402

CUDA_EXTENSION = "cydnn._C"
CPP_DIR = os.path.join("cpp")
CU_SOURCES = sorted(glob.glob(os.path.join(CPP_DIR, "*.cu")))
CU_HEADERS = sorted(glob.glob(os.path.join(CPP_DIR, "*.h")) + glob.glob(os.path.join(CPP_DIR, "*.cuh")))


def say(message):
    """A line on stderr (shown by `pip install -v`; setuptools' announce drops its own levels)."""
    print(message, file=sys.stderr, flush=True)


def arch_flags():
    archs = os.environ.get("CYDNN_CUDA_ARCHS")
    if archs:
        flags = []
        for a in archs.replace(",", " ").split():
            flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        return flags
    # nvcc 13 dropped sm_70; Ampere and Hopper cubins, plus PTX for newer GPUs.
    return ["-gencode", "arch=compute_80,code=sm_80",
            "-gencode", "arch=compute_90,code=sm_90",
            "-gencode", "arch=compute_90,code=compute_90"]


class BuildExtWithCuda(build_ext):
    """build_ext that first compiles the CUDA library with nvcc."""

    def build_extensions(self):
        tc = cuda_toolchain.probe()
        missing = tc.missing()
        if missing:
            raise RuntimeError("cannot build cydnn, missing:\n  - " + "\n  - ".join(missing))
        say(f"cydnn: nvcc {tc.nvcc}; cuDNN from the {tc.cudnn.source} ({tc.cudnn.lib_dir}); "
            f"cuBLAS from the {tc.cublas.source} ({tc.cublas.lib_dir}); CUDA runtime {tc.cudart_lib_dir}")
        staged = cuda_toolchain.stage_headers(tc, os.path.join(os.path.abspath(self.build_temp), "cuda_include"))
        objects = self.compile_cuda(tc, staged)
        if object_cache.unlink_if_objects_changed(objects, os.path.join(self.build_temp, "cuda_objects.sha256"),
                                                  self.get_ext_fullpath(CUDA_EXTENSION)):
            say("cydnn: the CUDA objects changed: the extension is linked again")

        import numpy
        for ext in self.extensions:
            if ext.name != CUDA_EXTENSION:
                continue
            ext.extra_objects += objects
            ext.include_dirs += [CPP_DIR, numpy.get_include()]
            ext.library_dirs += list(dict.fromkeys([tc.cudart_lib_dir, tc.cublas.lib_dir, tc.cudnn.lib_dir]))
            # The libraries have no unversioned .so links: name the sonames.
            ext.libraries += [":" + cuda_toolchain.CUDART_SONAME, ":libcublas.so.13",
                              ":libcublasLt.so.13", ":" + cuda_toolchain.CUDNN_SONAME]
            # For a regular install beside the wheels; editable and in-place
            # builds rely on cydnn/_libs.py, which preloads them by path.
            ext.extra_link_args += ["-Wl,-rpath,$ORIGIN/../nvidia/cu13/lib",
                                    "-Wl,-rpath,$ORIGIN/../nvidia/cudnn/lib"]
        self.compiler.compile = self.cached_compile(self.compiler.compile)
        super().build_extensions()

    def cached_compile(self, compile_fn):
        """The host compiler's ``compile``, taking each object from the object cache when there.

        The key: the generated C/C++ source (which holds everything Cython took from the .pyx,
        .pxi and .pxd files), cpp/*.h and the extension's ``depends`` (e.g. the C headers the CPU
        kernels' .pyx includes), the compiler's command line and ``--version``, and the Python and
        numpy whose headers it includes.  The temporary build folder is not part of it.
        """
        import sysconfig

        import numpy
        cache = object_cache.cache_dir()
        toolchain = (object_cache.tool_identity([self.compiler.compiler_so[0]])
                     + f"\npython {sys.version} {sysconfig.get_config_var('EXT_SUFFIX')}\nnumpy {numpy.__version__}")

        def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0, extra_preargs=None,
                    extra_postargs=None, depends=None):
            objects = self.compiler.object_filenames(sources, output_dir=output_dir)
            cmd = (list(self.compiler.compiler_so) + [repr(m) for m in (macros or [])] + list(include_dirs or [])
                   + list(extra_preargs or []) + list(extra_postargs or []) + [f"debug={debug}"])
            headers = [os.path.abspath(h) for h in list(CU_HEADERS) + list(depends or [])]
            keys = [object_cache.object_key(src, headers, cmd + [src], toolchain) for src in sources]
            missed = [(src, obj, key) for src, obj, key in zip(sources, objects, keys)
                      if self.force or not object_cache.fetch(cache, key, obj)]
            if missed:
                compile_fn([src for src, _, _ in missed], output_dir=output_dir, macros=macros,
                           include_dirs=include_dirs, debug=debug, extra_preargs=extra_preargs,
                           extra_postargs=extra_postargs, depends=depends)
                for _, obj, key in missed:
                    object_cache.store(cache, key, obj)
            say(f"cydnn: {len(sources) - len(missed)} of {len(sources)} host objects from the cache ({cache or 'off'})")
            return objects

        return compile

    def compile_cuda(self, tc, staged_include):
        """nvcc -c every cpp/*.cu, each object taken from the object cache when its key is there."""
        out_dir = os.path.join(os.path.abspath(self.build_temp), "cuda")
        os.makedirs(out_dir, exist_ok=True)
        cpp_dir = os.path.abspath(CPP_DIR)
        base = [tc.nvcc, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "--threads", "1",
                "-I" + cpp_dir, "-I" + staged_include] + arch_flags()
        # extra nvcc flags for a developer's build, e.g. CYDNN_NVCC_FLAGS=-lineinfo for ncu's source view
        base += os.environ.get("CYDNN_NVCC_FLAGS", "").split()
        cache = object_cache.cache_dir()
        staged = sorted(glob.glob(os.path.join(staged_include, "*.h")))
        toolchain = object_cache.tool_identity([tc.nvcc], [shutil.which("gcc") or "gcc"])
        hits = []

        def compile_one(src):
            src = os.path.abspath(src)
            obj = os.path.join(out_dir, os.path.basename(src)[:-3] + ".o")
            cmd = base + ["-c", src, "-o", obj]
            headers = object_cache.local_includes(src, cpp_dir) + staged     # only what the source includes
            key = object_cache.object_key(src, headers, cmd, toolchain, replacements=[
                (obj, "<object>"), (src, "<source>"), (cpp_dir, "<cpp>"), (staged_include, "<cuda_include>")])
            if not self.force and object_cache.fetch(cache, key, obj):
                hits.append(src)
                return obj
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"nvcc failed on {src}:\n{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
            object_cache.store(cache, key, obj)
            return obj

        workers = max(1, min(len(CU_SOURCES), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            objects = list(pool.map(compile_one, CU_SOURCES))
        say(f"cydnn: {len(hits)} of {len(objects)} CUDA objects from the cache ({cache or 'off'})")
        return objects


def extensions():
    from Cython.Build import cythonize
    ext = Extension(
        CUDA_EXTENSION,
        sources=[os.path.join("python", "cydnn", "_C.pyx")],
        language="c++",
        extra_compile_args=["-O2", "-std=c++17"],
    )
    # The CPU kernels: plain C, OpenMP, no CUDA.  -ffp-contract=off keeps a*b + c two roundings,
    # as in numpy (the tests compare the kernels with the numpy twin bit for bit where they can).
    # The C headers _kernels_*.h (hot loops with AVX2 versions chosen at run time) are included from
    # the .pyx: their folder is on the include path, and as `depends` a change to one rebuilds the
    # extension -- also through the object cache, whose key has every file of `depends`.
    kernels_dir = os.path.join("python", "cydnn", "ops", "cpu")
    kernels_headers = sorted(glob.glob(os.path.join(kernels_dir, "_kernels_*.h")))
    kernels = Extension(
        "cydnn.ops.cpu._kernels",
        sources=[os.path.join(kernels_dir, "_kernels.pyx")],
        depends=kernels_headers + sorted(glob.glob(os.path.join(kernels_dir, "_kernels_*.pxi"))),
        include_dirs=[kernels_dir],
        language="c",
        extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
        extra_link_args=["-fopenmp"],
    )
    directives = {"language_level": 3, "embedsignature": True}
    return (cythonize([ext], compiler_directives=directives, include_path=[os.path.join("python", "cydnn")])
            # its generated C goes to build/cython, not beside the .pyx
            + cythonize([kernels], compiler_directives=directives, build_dir=os.path.join("build", "cython")))


class BuildPyWithKernelSources(build_py):
    """build_py that also installs the headers a kernel generated at run time includes
    (python/cydnn/compiler/fused_net_gen.py reads them from cydnn/_cuda_src; an editable install reads
    cpp/ itself)."""

    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "cydnn", "_cuda_src")
        os.makedirs(dest, exist_ok=True)
        for name in ("cydnn.h", "fused_net_rtc.cuh", "fused_net_conv.cuh", "fused_net_wsplit.cuh",
                     "fused_net_layers.cuh"):
            shutil.copy2(os.path.join(CPP_DIR, name), os.path.join(dest, name))


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExtWithCuda, "build_py": BuildPyWithKernelSources})
