"""This package's CUDA kernels kept in MLX's kernel folder, so that a machine compiles
each one once instead of once per process.

MLX compiles a kernel made with `mx.fast.cuda_kernel` with NVRTC in every process and
never writes it to disk (custom_kernel.cpp passes `use_disk_cache=false`), but it
looks in its kernel folder first (jit_module.cpp `read_cached_ptx`), under the name
`<kernel>_<hash>`: `custom_kernel_<name>` with its template arguments, then
libstdc++'s `std::hash` of the whole source MLX generates around ours, in hex. On an
H200 host each compile takes 1-4 s, and an engine's load runs several (its decode
attention, a hybrid model's recurrent kernels), in every process.

So `cuda_kernel` here is MLX's, and the first calls of each kernel also build that
source and name as MLX does (`generated`). Where the folder lacks the file, a helper
process (a few seconds later, at low priority) compiles the source as MLX would:
NVRTC with MLX's own device headers (read from libmlx.so), its include paths and the
device's architecture, and writes the result there as MLX's reader expects it. The
process that runs a kernel first still compiles it; later ones load it in
milliseconds. A load that knows its kernels ahead (own_kernels.py) makes its calls
unevaluated and has helpers compile them all at once (`write_now`) before it
evaluates them, so even the first process loads them. Nothing here is needed for a
kernel to run: where a piece is missing
(no NVRTC library, headers not found, a compile error), MLX compiles it as before,
and the engine's load checks still compare every kernel with MLX's ops.

The helper (`python kernel_files.py job.json`) imports only the standard library.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["cuda_kernel", "generated", "module_file", "std_hash", "write_now"]

CHECKED_CALLS = 256  # calls of a kernel that look for new shapes; later ones go straight
QUIET_S = 2.0  # a helper starts once no new kernel appeared for this long

# mlx/backend/cuda/utils.cpp dtype_to_cuda_type, and backend/common/compiled.cpp
# get_type_string (template dtypes in the kernel's name)
_CUDA_TYPE = {"bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t",
              "int64": "int64_t", "uint8": "uint8_t", "uint16": "uint16_t",
              "uint32": "uint32_t", "uint64": "uint64_t", "float16": "__half",
              "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double",
              "complex64": "mlx::core::cu::complex64_t"}
_NAME_TYPE = dict(_CUDA_TYPE, float16="float16_t", bfloat16="bfloat16_t",
                  complex64="complex64_t")
_DEFAULT_HEADER = ('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n'
                   "#include <cooperative_groups.h>\n\n")
# the headers MLX hands NVRTC from memory (jit_module.cpp g_include_names)
_HEADERS = ("atomic_ops.cuh", "binary_ops.cuh", "cast_op.cuh", "config.h", "complex.cuh",
            "cute_dequant.cuh", "fp16_math.cuh", "gemm_sm70.cuh", "hadamard.cuh",
            "indexing.cuh", "qmm_naive.cuh", "qmm_sm80.cuh", "qmm_sm90.cuh",
            "scatter_ops.cuh", "unary_ops.cuh", "ternary_ops.cuh", "utils.cuh")


def std_hash(data: bytes) -> int:
    """libstdc++'s `std::hash<std::string>` on 64-bit hosts (`_Hash_bytes`, seed
    0xc70f6907: a MurmurHash64A variant)."""
    m, mul = (1 << 64) - 1, 0xc6a4a7935bd1e995

    def mix(v):
        return v ^ (v >> 47)

    n = len(data)
    whole = n & ~7
    h = (0xc70f6907 ^ (n * mul)) & m
    for (word,) in struct.iter_unpack("<Q", data[:whole]):
        h = ((h ^ ((mix((word * mul) & m) * mul) & m)) * mul) & m
    if n & 7:
        h = ((h ^ int.from_bytes(data[whole:], "little")) * mul) & m
    return mix((mix(h) * mul) & m)


def _dtype(d) -> str:
    return str(d).rsplit(".", 1)[-1]


def generated(name, input_names, output_names, source, header, inputs, output_dtypes,
              template):
    """(kernel name, source) as MLX's custom_kernel.cpp builds them for a call with
    these inputs (arrays), output dtypes and template arguments."""
    kname = "custom_kernel_" + name
    lines = []
    for tname, v in template:
        if isinstance(v, bool):
            kname += "_t" if v else "_f"
            lines.append(f"  constexpr bool {tname} = {'true' if v else 'false'};\n")
        elif isinstance(v, int):
            kname += f"_{v}"
            lines.append(f"  constexpr int {tname} = {v};\n")
        else:
            kname += "_" + _NAME_TYPE[_dtype(v)]
            lines.append(f"  using {tname} = {_CUDA_TYPE[_dtype(v)]};\n")
    s = [_DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\n",
         "namespace cg = cooperative_groups;\n\n", f"__global__ void {kname}(\n"]
    for n, a in zip(input_names, inputs):
        s.append(f"    const {_CUDA_TYPE[_dtype(a.dtype)]}* {n},\n")
        if a.ndim > 0:
            for part, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if n + part in source:
                    s.append(f"    const __grid_constant__ {kind} {n}{part},\n")
    s.append(",\n".join(f"    {_CUDA_TYPE[_dtype(d)]}* {n}"
                        for n, d in zip(output_names, output_dtypes)) + ") {\n")
    if lines:
        s += lines + ["\n"]
    s += [source, "\n}\n\n} // namespace mlx::core::cu\n"]
    return kname, "".join(s)


def module_file(folder: Path, kname: str, src: str) -> Path:
    """Where MLX reads the compiled module of (kernel name, source): jit_module.cpp
    `get_ptx_path` (names over 245 characters become nested folders)."""
    module = f"{kname}_{std_hash(src.encode()):x}"
    path, cap = Path(folder), 245
    while len(module) > cap:
        path, module = path / module[:cap], module[cap:]
    return path / (module + ".ptx")


class _Kernel:
    """MLX's kernel; its first calls note each new build (see the module docstring)."""

    def __init__(self, kernel, spec):
        self._kernel, self._spec, self._left, self._seen = kernel, spec, CHECKED_CALLS, set()

    def __call__(self, *args, **kw):
        if self._left and not args:
            self._left -= 1
            _note(self, kw)
        return self._kernel(*args, **kw)


def cuda_kernel(name, input_names, output_names, source, header="",
                ensure_row_contiguous=True, **kw):
    """`mx.fast.cuda_kernel`, whose builds later processes load from MLX's folder."""
    import mlx.core as mx

    kernel = mx.fast.cuda_kernel(name=name, input_names=input_names,
                                 output_names=output_names, source=source, header=header,
                                 ensure_row_contiguous=ensure_row_contiguous, **kw)
    if _toolchain() is None:
        return kernel
    return _Kernel(kernel, (name, list(input_names), list(output_names), source, header))


# -- the loop of the engine's process: what to compile, and the helper ---------------

_LOCK = threading.Lock()
_PENDING = {}  # file -> (kernel name, source)
_TIMER = []
_TOOLS = []  # [toolchain dict or None], found once


def _note(k: _Kernel, kw) -> None:
    import mlx.core as mx

    try:
        inputs, template = kw["inputs"], kw.get("template") or []
        if not all(isinstance(a, mx.array) for a in inputs):
            return  # (MLX converts scalars; such calls are left to it)
        key = (tuple((_dtype(a.dtype), a.ndim > 0) for a in inputs),
               tuple((n, type(v).__name__, v if isinstance(v, int) else _dtype(v))
                     for n, v in template),
               tuple(_dtype(d) for d in kw["output_dtypes"]))
        if key in k._seen:
            return
        k._seen.add(key)
        kname, src = generated(*k._spec[:5], inputs, kw["output_dtypes"], template)
        path = module_file(_toolchain()["folder"], kname, src)
        if path.exists() or path.with_suffix(".failed").exists():
            return
        with _LOCK:
            _PENDING[str(path)] = (kname, src)
            for t in _TIMER:
                t.cancel()
            t = threading.Timer(QUIET_S, _start_helper)
            t.daemon = True
            _TIMER[:] = [t]
            t.start()
    except Exception:  # noting is an optimization: a call never fails for it
        from ..._log import swallowed

        swallowed("noting a CUDA kernel for MLX's kernel folder")


def _toolchain():
    """What the helper needs, found once: MLX's kernel folder, libmlx.so (its device
    headers), libnvrtc, the include paths MLX passes and the device's architecture;
    None where a piece is missing or MLX runs another backend."""
    if _TOOLS:
        return _TOOLS[0]
    _TOOLS.append(None)
    try:
        import mlx.core as mx

        if not mx.cuda.is_available() or os.environ.get("MLXNB_KERNEL_FILES") == "0":
            return None
        from ...models.kernel_cache import gpu_models, ptx_dir

        if len(gpu_models()) > 1:  # one folder, GPUs of two architectures maybe
            return None
        libs = _loaded_libraries()
        mlx_lib = next((p for p in libs if Path(p).name == "libmlx.so"), None)
        nvrtc = next((p for p in libs if Path(p).name.startswith("libnvrtc.so")), None)
        info = mx.device_info()
        if not (mlx_lib and nvrtc and "compute_capability_major" in info):
            return None
        root = Path(mlx_lib).parent.parent  # as jit_module.cpp include_path_args
        includes = [root / "include"]
        cccl = root / "include" / "cccl"
        includes += [cccl] if cccl.exists() else []
        # the CUDA headers: the runtime package beside MLX's, else the toolkit's
        found = next((p for p in (root.parent / "nvidia" / d / "include"
                                  for d in ("cu13", "cuda_runtime")) if p.exists()), None)
        if found is None:
            home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
            found = Path(home or "/usr/local/cuda") / "include"
            if not found.exists():
                return None
        _TOOLS[0] = dict(folder=str(ptx_dir()), libmlx=mlx_lib, nvrtc=nvrtc,
                         includes=[str(p) for p in includes + [found]],
                         cc=[int(info["compute_capability_major"]),
                             int(info["compute_capability_minor"])])
    except Exception:
        return None
    return _TOOLS[0]


def _loaded_libraries():
    """Paths of the shared libraries this process has mapped (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split(None, 5)[5].strip() for line in f
                           if line.count(" ") >= 5 and ".so" in line})
    except OSError:
        return []


def _take_jobs() -> dict:
    with _LOCK:
        jobs = dict(_PENDING)
        _PENDING.clear()
        for t in _TIMER:
            t.cancel()
        _TIMER.clear()
    return jobs


def _spawn(jobs: dict, tools: dict, **how):
    """The helper for `jobs`, or None; `how`: threads, nice (the job file's keys)."""
    job = None
    try:
        fd, job = tempfile.mkstemp(prefix="mlxnb-kernels-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(dict(tools, jobs=[[p, k, s] for p, (k, s) in jobs.items()], **how), f)
        return subprocess.Popen([sys.executable, __file__, job], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except Exception:  # (may run on a timer thread: nothing may escape)
        from ..._log import swallowed

        swallowed("starting the CUDA kernel writer")
        if job is not None and os.path.exists(job):
            os.unlink(job)
        return None


def _start_helper() -> None:
    jobs, tools = _take_jobs(), _toolchain()
    if jobs and tools is not None:
        _spawn(jobs, tools)


def write_now(timeout: float = 60.0) -> int:
    """Compile every build noted so far (calls made, not yet evaluated) now, each in
    a helper of its own at normal priority (one process compiles with NVRTC one
    program at a time, even on several threads: on an H100 host five landed 1.7 s
    apart), and wait for them up to `timeout` s; how many. Evaluating those calls
    then loads each from MLX's folder instead of compiling them one after another in
    this process. A build a helper could not make, or not in time, MLX compiles as
    before."""
    jobs, tools = _take_jobs(), _toolchain()
    if not jobs or tools is None:
        return 0
    procs = [_spawn({path: job}, tools, threads=1, nice=0) for path, job in jobs.items()]
    end = time.monotonic() + timeout
    for proc in procs:
        if proc is not None:
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    return len(jobs)


# -- the helper process --------------------------------------------------------------

def device_headers(libmlx: str) -> dict:
    """{include name: text} of the device headers MLX compiles kernels with, read
    from libmlx.so's symbol table (`mlx::core::jit_source_<name>`, char arrays in
    .rodata); {} where the library keeps no such table."""
    with open(libmlx, "rb") as f:
        elf = f.read()
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:  # 64-bit little-endian only
        return {}
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    symtab = next((s for s in secs if s[1] == 2), None)  # SHT_SYMTAB
    if symtab is None:
        return {}
    strtab = secs[symtab[6]]
    names = elf[strtab[4]:strtab[4] + strtab[5]]
    wanted = {}
    for h in _HEADERS:
        mangled = "jit_source_" + h.split(".")[0]
        start = 0
        while (i := names.find(mangled.encode() + b"E\x00", start)) >= 0:
            start = i + 1
            at = names.rfind(b"\x00", 0, i) + 1  # the symbol name's start
            wanted[at] = h
    found = {}
    for (st_name, _, _, shndx, value, size) in struct.iter_unpack(
            "<IBBHQQ", elf[symtab[4]:symtab[4] + symtab[5]]):
        h = wanted.get(st_name)
        if h is None or h in found or not (0 < shndx < len(secs)) or not size:
            continue
        sec = secs[shndx]
        off = sec[4] + value - sec[3]
        found[h] = elf[off:off + size].rstrip(b"\x00").decode()
    return {f"mlx/backend/cuda/device/{h}": t for h, t in found.items()}


def _compile(lib, tools, headers, module, src, kname):
    """(binary, mangled name) as jit_module.cpp `compile` makes them."""
    def check(r):
        if r != 0:
            raise RuntimeError(f"nvrtc error {r}")

    prog = ctypes.c_void_p()
    names = list(headers)
    hs = (ctypes.c_char_p * len(names))(*[headers[n].encode() for n in names])
    ns = (ctypes.c_char_p * len(names))(*[n.encode() for n in names])
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), (module + ".cu").encode(),
                                 len(names), hs, ns))
    try:
        full = ("mlx::core::cu::" + kname).encode()
        check(lib.nvrtcAddNameExpression(prog, full))
        major, minor = ctypes.c_int(), ctypes.c_int()
        check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
        cc = tools["cc"]
        sass = _device_sass(major.value, minor.value, cc)
        opts = [b"--device-as-default-execution-space",
                ("--gpu-architecture=%s_%d%d%s" % ("sm" if sass else "compute", cc[0], cc[1],
                                                    "a" if cc[0] >= 9 else "")).encode()]
        opts += [f"--include-path={p}".encode() for p in tools["includes"]]
        check(lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)))
        mangled = ctypes.c_char_p()
        check(lib.nvrtcGetLoweredName(prog, full, ctypes.byref(mangled)))
        size = ctypes.c_size_t()
        get_size, get = ((lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if sass
                         else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX))
        check(get_size(prog, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        check(get(prog, buf))
        return buf.raw, full.decode(), mangled.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _device_sass(major, minor, cc) -> bool:
    """jit_module.cpp `compiler_supports_device_sass`."""
    if major < 9:
        return False
    limit = {9: (7, 2), 10: (7, 5)}.get(major)
    if major == 11 and minor == 0:
        limit = (8, 0)
    elif major == 11 and minor < 8:
        limit = (8, 6)
    return limit is None or tuple(cc) <= limit


def _write(path: Path, binary: bytes, full: str, mangled: str) -> None:
    """The .txt (kernel names) first, then the .ptx: MLX reads a module once its .ptx
    exists (compilers.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, data in ((path.with_suffix(".txt"), f"{full}\t{mangled}\n".encode()),
                         (path, binary)):
        tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, target)


def _helper(job: str) -> None:
    with open(job) as f:
        tools = json.load(f)
    os.unlink(job)
    try:  # (low by default: it writes for later processes, beside a running engine)
        os.nice(tools.get("nice", 10))
    except OSError:
        pass
    headers = device_headers(tools["libmlx"])
    if "mlx/backend/cuda/device/utils.cuh" not in headers:
        return
    lib = ctypes.CDLL(tools["nvrtc"])

    def one(job):
        path, kname, src = Path(job[0]), job[1], job[2]
        if path.exists():
            return
        module = path.relative_to(tools["folder"]).as_posix().replace("/", "")[:-4]
        try:
            _write(path, *_compile(lib, tools, headers, module, src, kname))
        except Exception as e:  # a mark, so later processes leave it to MLX at once
            try:
                path.with_suffix(".failed").write_text(f"{kname}: {e}\n")
            except OSError:
                pass

    # NVRTC compiles programs on several threads at once (ctypes lets go of the GIL)
    from concurrent.futures import ThreadPoolExecutor

    threads = tools.get("threads") or max(1, min(4, (os.cpu_count() or 2) // 2))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, tools["jobs"]))


if __name__ == "__main__":
    _helper(sys.argv[1])
