"""Small C kernels for CPUs, compiled once per machine and loaded with ctypes.

`build(name, source)` returns the loaded library: a prebuilt one where `prebuilt_dir()` holds it
(named by source and flags), else one compiled with the system C compiler (the one torch.compile
also needs) into ~/.cache/iterserve/native, keyed by source, compiler and instruction-set flags;
None where neither works (the caller logs its fallback). A ctypes call releases the GIL, so a
kernel runs while other Python threads go on.

Prebuilt kernels (`python -m iterserve.engine.native prebuild`): the CPU image has no compiler,
so its build compiles every kernel for every instruction-set path into the image; `make install`
fills the venv's folder for this CPU, so an engine whose HOME is fresh (a pod of the local
runtime) starts without compiling (the GGUF kernel alone takes ~50 s of one core).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# The kernels' worker pool: threads that spin briefly, then sleep on a futex, until the generation
# counter moves, then run their share. Put after the kernel's own `share_t`, `run_share()`,
# MAX_THREADS and SPIN_ROUNDS; it needs pthread.h, stdatomic.h, linux/futex.h, sched.h,
# sys/syscall.h and immintrin.h.
THREAD_POOL = r"""
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int pool_generation, pool_pending, pool_sleepers;
static int pool_workers;
static share_t pool_shares[MAX_THREADS];
static int pool_start_generation[MAX_THREADS]; /* the generation a worker was created in (under pool_lock) */

static void* worker_main(void* arg) {
    const int id = (int)(intptr_t)arg;
    int seen = pool_start_generation[id];
    for (;;) {
        int rounds = 0, now;
        while ((now = atomic_load(&pool_generation)) == seen) {
            if (++rounds < SPIN_ROUNDS) {
                for (int i = 0; i < 16; i++) _mm_pause();
                if ((rounds & 15) == 0) sched_yield();
            } else {
                atomic_fetch_add(&pool_sleepers, 1);
                syscall(SYS_futex, &pool_generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&pool_sleepers, 1);
            }
        }
        seen = now;
        run_share(&pool_shares[id]);
        atomic_fetch_sub(&pool_pending, 1);
    }
    return NULL;
}

/* A forked child has none of the parent's workers: start over (else a call would wait for them). */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool_lock, NULL);
    pool_workers = 0;
    atomic_store(&pool_pending, 0);
    atomic_store(&pool_sleepers, 0);
}

static int ensure_workers(int wanted) {
    static int fork_handler;
    if (!fork_handler) fork_handler = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    while (pool_workers < wanted) {
        pthread_t id;
        pool_start_generation[pool_workers + 1] = atomic_load(&pool_generation);
        if (pthread_create(&id, NULL, worker_main, (void*)(intptr_t)(pool_workers + 1)) != 0) break;
        pthread_detach(id);
        pool_workers++;
    }
    return pool_workers;
}
"""

# C helpers for AVX2 kernels, put before a kernel's own source (they compile to nothing without AVX2).
AVX2_HELPERS = r"""
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

/* Cephes' expf (about 1 ulp), 8 lanes; inputs clamped to [-87, 88] so 2^n stays a normal float. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif
"""

# Reassociation lets the dot products and the accumulation vectorise; no -ffast-math, which
# would assume finite values and, linked into a shared object, may flush denormals process-wide.
BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-pthread", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
              "-fno-signed-zeros"]


def has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


AVX2_FLAGS = ["-mavx2", "-mfma"]
PREBUILT_ENV = "ITERSERVE_NATIVE_PREBUILT"
# The modules whose kernels `prebuild` compiles: each has native_builds(every_isa) -> [(name, source, flags)].
KERNEL_MODULES = ("iterserve.engine.attention.cpu_paged", "iterserve.engine.model.cpu_fused",
                  "iterserve.engine.model.cpu_gguf", "iterserve.engine.model.cpu_w8a8")


def isa_flags() -> list[str]:
    # Never -march=native: the cache directory can outlive the machine (VMs change CPUs between runs).
    return AVX2_FLAGS if has_avx2() else []


def prebuilt_dir() -> Path:
    """Where prebuilt kernels are looked for: $ITERSERVE_NATIVE_PREBUILT, else the environment's
    share/iterserve/native (the image's venv, or .venv)."""
    return Path(os.environ.get(PREBUILT_ENV) or Path(sys.prefix) / "share" / "iterserve" / "native")


def prebuilt_name(name: str, source: str, flags: list[str]) -> str:
    """A prebuilt library's file name: by source and every flag, not by compiler (a machine that
    loads it may have none)."""
    return f"{name}_{hashlib.sha256(chr(0).join([source, *flags]).encode()).hexdigest()[:16]}.so"


def cache_dir() -> Path:
    preferred = Path.home() / ".cache" / "iterserve" / "native"
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        if os.access(preferred, os.W_OK):
            return preferred
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"iterserve-native-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def find_compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build(name: str, source: str, flags: list[str] | None = None) -> ctypes.CDLL | None:
    """The library compiled from source (cached); None, with a warning naming why, where it cannot
    be built here."""
    flags = BASE_FLAGS + isa_flags() + list(flags or [])
    prebuilt = prebuilt_dir() / prebuilt_name(name, source, flags)
    if prebuilt.is_file():
        try:
            return ctypes.CDLL(str(prebuilt))
        except OSError as error:
            logger.warning("the prebuilt %s kernel %s did not load (%s): compiling it", name, prebuilt, error)
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C compiler found (set CC or install gcc) and no prebuilt %s kernel in %s "
                       "(python -m iterserve.engine.native prebuild): the kernel is unavailable", name,
                       prebuilt_dir())
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([source, compiler, version, *flags]).encode()).hexdigest()[:16]
        directory = cache_dir()
        library = directory / f"{name}_{key}.so"
        if not library.exists():
            _compile(compiler, source, flags, library, timeout=120)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("the %s kernel did not build (%s)", name, detail)
        return None


def _compile(compiler: str, source: str, flags: list[str], library: Path, timeout: float) -> None:
    """Compile source into library through a temporary file, renamed into place (atomic: a
    concurrent engine never loads a half-written file); raises CalledProcessError on failure."""
    source_file = library.with_suffix(f".{os.getpid()}.c")
    partial = library.with_suffix(f".{os.getpid()}.so")
    source_file.write_text(source)
    try:
        subprocess.run([compiler, *flags, str(source_file), "-o", str(partial), "-lm"], check=True,
                       capture_output=True, text=True, timeout=timeout)
        os.replace(partial, library)
    finally:
        source_file.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)


def prebuild(directory: Path, every_isa: bool) -> list[Path]:
    """Compile every kernel (for every instruction-set path, or this CPU's) into directory, for
    AVX2 CPUs, as build() would name them; the ones already there are kept. Raises
    RuntimeError naming the kernel and the compiler's message where one does not compile."""
    import importlib

    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found: set CC or install gcc")
    directory.mkdir(parents=True, exist_ok=True)
    jobs = []
    for module in KERNEL_MODULES:
        for name, source, extra in importlib.import_module(module).native_builds(every_isa):
            flags = BASE_FLAGS + AVX2_FLAGS + extra
            jobs.append((name, source, flags, directory / prebuilt_name(name, source, flags)))

    def compile_one(job) -> Path:
        name, source, flags, target = job
        if target.is_file():
            logger.info("%s: %s is there", name, target.name)
            return target
        started = time.monotonic()
        try:
            _compile(compiler, source, flags, target, timeout=600)
        except subprocess.CalledProcessError as error:
            raise RuntimeError(f"the {name} kernel did not compile:\n{error.stderr[-4000:]}") from None
        logger.info("%s: compiled %s in %.1f s", name, target.name, time.monotonic() - started)
        return target

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(compile_one, jobs))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m iterserve.engine.native",
        description="Compile the CPU kernels ahead of time, so that engines load them without a C compiler "
                    "and without compiling at start-up.")
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("prebuild", help="compile every kernel into a folder build() looks in")
    pre.add_argument("directory", nargs="?", type=Path, default=None,
                     help=f"default: ${PREBUILT_ENV}, else <this environment>/share/iterserve/native "
                          f"(here {prebuilt_dir()})")
    pre.add_argument("--every-isa", action="store_true",
                     help="also the paths this CPU cannot run (AVX-512 VNNI, AVX-VNNI): for an image "
                          "that runs on any x86-64 node with AVX2")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    directory = args.directory or prebuilt_dir()
    started = time.monotonic()
    try:
        built = prebuild(directory, args.every_isa)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{len(built)} kernels in {directory} ({time.monotonic() - started:.1f} s)")
    return 0


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A torch.profiler label for a kernel call while a profile is recording (bench/kernels/step_profile.py
    names the kernels in its top ops), else nothing: record_function costs ~10 us a call."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


if __name__ == "__main__":
    sys.exit(main())
