"""Device compilers: turn a rendered :class:`~ds4c.runtime.render.KernelSource` into a loadable binary.

CUDA gives a cubin (``nvcc -cubin``, or NVRTC through ``cuda.bindings.nvrtc`` when nvcc is absent); HIP gives
an AMDGPU code object (``.hsaco``: an ELF shared object that ``hipModuleLoadData`` accepts), built by
``hipcc`` or by a plain ``clang`` >= 19 with no ROCm install (``-nogpuinc -nogpulib``: the vendor prelude
brings every builtin it needs). Nothing here queries a GPU: the arch is always explicit input.

Flags (``Toolchain.flags``), besides the input and ``-o`` output:

* nvcc: ``-cubin -O3 -std=c++17 -arch=sm_90 -Xptxas -v -diag-suppress 177`` (``-Xptxas -v`` puts registers,
  spills, shared memory and stack into the log; warning 177 is "function declared but never referenced",
  which every prelude helper a kernel does not use would raise); ``sm_90a`` / ``sm_100a`` use
  ``-gencode=arch=compute_90a,code=sm_90a`` instead of ``-arch``.
* nvrtc: ``--gpu-architecture=sm_90 -std=c++17 -Xptxas=-v -diag-suppress=177`` (NVRTC optimizes by default).
* clang / hipcc: ``-x hip --offload-arch=gfx942 --cuda-device-only -nogpuinc -nogpulib --no-gpu-bundle-output
  -fuse-cuid=none -O3 -std=c++17 -mwavefrontsize64|-mno-wavefrontsize64 -Rpass-analysis=kernel-resource-usage``.
  ``--no-gpu-bundle-output`` makes the output the linked (lld) code object itself instead of a clang offload
  bundle; ``-fuse-cuid=none`` keeps the binary independent of the source's path; the wave-size flag pins the
  wavefront to the target's ``wave`` (which the prelude's ``DS4C_WAVE`` assumes); the remark flag puts
  SGPRs/VGPRs/LDS/scratch into the log.

Compiler versions are read once per process (``nvcc --version``, ``clang --version``).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ds4c import settings
from ds4c.errors import Ds4cError
from ds4c.runtime.render import KernelSource
from ds4c.runtime.targets import Target
from ds4c.write_errors import device_full, no_space_error

MIN_CLANG_MAJOR = 19
COMPILE_TIMEOUT_S = 600.0
CUDA_TOOLCHAINS = ("nvcc", "nvrtc")
HIP_TOOLCHAINS = ("hipcc", "clang")
_LOG_TAIL_LINES = 40

_INSTALL_CUDA = ("install the CUDA toolkit (nvcc on PATH, or $CUDA_HOME/bin/nvcc), or NVRTC for Python: "
                 "pip install cuda-bindings nvidia-cuda-nvrtc")
_INSTALL_HIP = ("install clang >= 19 with lld (Debian/Ubuntu: apt-get install clang-19 lld-19; tools/setup.sh does "
                "this when run as root), or ROCm's hipcc")


class ToolchainError(Ds4cError):
    """No usable compiler for a target: none installed, too old, or it does not support the arch."""


class CompileError(Ds4cError):
    """A kernel failed to compile. ``kernel``, ``target`` (slug), ``command`` and ``log`` (the compiler's
    output) are kept as attributes; the message has the command line and the tail of the log."""

    def __init__(self, kernel: str, target: Target, command: Sequence[str], log: str, reason: str = ""):
        self.kernel, self.target, self.command, self.log = kernel, target.slug, list(command), log
        tail = "\n".join(log.rstrip().splitlines()[-_LOG_TAIL_LINES:])
        super().__init__(f"compiling kernel {kernel!r} for {target.slug} failed{': ' + reason if reason else ''}\n"
                         f"  command: {_shell_join(command)}\n"
                         + ("  compiler output (tail):\n" + _indent(tail) if tail else "  (no compiler output)"))


def _shell_join(cmd: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(c) for c in cmd)


def _indent(text: str) -> str:
    return "\n".join("    " + ln for ln in text.splitlines())


@dataclass(frozen=True)
class CompileResult:
    """One compile's output: ``binary`` (cubin or hsaco bytes), ``kind`` (``"cubin"`` | ``"hsaco"``), ``log``
    (everything the compiler printed: warnings, ``ptxas -v`` info, clang resource remarks), ``seconds`` (wall
    time of the compile), ``command`` (the command line run, or the NVRTC options)."""

    binary: bytes
    kind: str
    log: str
    seconds: float
    command: tuple[str, ...] = field(default=())


COMPILER_TMP = ".cc-tmp"
"""The folder inside a compile's work folder that the compiler's own temporary files go to (``TMPDIR``)."""


def _run(cmd: Sequence[str], cwd: Path, timeout: float = COMPILE_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run one compiler command (stdout and stderr together, text) in ``cwd``, with ``TMPDIR`` (and ``TMP``,
    ``TEMP``) set to ``cwd/.cc-tmp`` so that nvcc's and clang's intermediate files stay inside the work folder
    (a killed compile leaves them there, where the kernel cache's sweep finds them, not in /tmp); the folder is
    removed afterwards. Tests wrap this to count compiles."""
    tmp = Path(cwd) / COMPILER_TMP
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "TMP": str(tmp), "TEMP": str(tmp)}
    try:
        return subprocess.run(list(cmd), cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", timeout=timeout, stdin=subprocess.DEVNULL, env=env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class Toolchain:
    """A device compiler. ``name``: ``nvcc`` | ``nvrtc`` | ``hipcc`` | ``clang``; ``version``: the compiler's own
    version text (part of cache keys); ``path``: the executable (None for NVRTC). The path is never part of a
    cache key, so a moved install does not invalidate the cache."""

    name: str
    version: str
    path: str | None = None

    @property
    def vendor(self) -> str:
        if self.name in CUDA_TOOLCHAINS:
            return "cuda"
        if self.name in HIP_TOOLCHAINS:
            return "hip"
        raise ToolchainError(f"unknown toolchain {self.name!r}: expected one of "
                             f"{', '.join(CUDA_TOOLCHAINS + HIP_TOOLCHAINS)}")

    @property
    def kind(self) -> str:
        """Binary kind this toolchain produces."""
        return "cubin" if self.vendor == "cuda" else "hsaco"

    def _check_target(self, target: Target) -> None:
        if target.vendor != self.vendor:
            raise ToolchainError(f"toolchain {self.name} compiles for {self.vendor}, not for {target.slug}")

    def flags(self, target: Target) -> list[str]:
        """Compiler options for ``target`` (no input file, no output path). Part of every cache key.

        Raises:
            ToolchainError: ``target`` is of the other vendor.
        """
        self._check_target(target)
        a = target.arch
        if self.name == "nvcc":
            arch = ([f"-gencode=arch=compute_{a[3:]},code={a}"] if a.endswith("a") else [f"-arch={a}"])
            return ["-cubin", "-O3", "-std=c++17", *arch, "-Xptxas", "-v", "-diag-suppress", "177"]
        if self.name == "nvrtc":
            return [f"--gpu-architecture={a}", "-std=c++17", "-Xptxas=-v", "-diag-suppress=177"]
        if self.name in HIP_TOOLCHAINS:
            return ["-x", "hip", f"--offload-arch={a}", "--cuda-device-only", "-nogpuinc", "-nogpulib",
                    "--no-gpu-bundle-output", "-fuse-cuid=none", "-O3", "-std=c++17",
                    "-mwavefrontsize64" if target.wave == 64 else "-mno-wavefrontsize64",
                    "-Rpass-analysis=kernel-resource-usage"]
        raise ToolchainError(f"toolchain {self.name!r} has no flags")  # pragma: no cover - vendor() raised

    def compile(self, src: KernelSource, workdir: Path) -> CompileResult:
        """Compile ``src`` in ``workdir`` (which must exist): writes ``kernel.cu`` / ``kernel.hip`` and
        ``kernel.cubin`` / ``kernel.hsaco`` there and returns the binary and the log.

        Raises:
            ToolchainError: ``src.target`` is of the other vendor.
            CompileError: the compiler failed (or timed out, or wrote no valid binary).
            OSError: ``workdir``'s device is full (ENOSPC; also when the compiler exited 0 on it: its output cannot
                be trusted then).
        """
        flags = self.flags(src.target)
        workdir = Path(workdir)
        src_file = workdir / f"kernel{src.ext}"
        out_file = workdir / f"kernel.{self.kind}"
        src_file.write_text(src.source)
        if self.name == "nvrtc":
            return _nvrtc_compile(src, flags, out_file)
        assert self.path is not None
        cmd = [self.path, *flags, "-o", out_file.name, src_file.name]
        t0 = time.perf_counter()
        try:
            proc = _run(cmd, workdir)
        except subprocess.TimeoutExpired as e:
            out = e.output.decode(errors="replace") if isinstance(e.output, bytes) else (e.output or "")
            raise CompileError(src.name, src.target, cmd, out, f"timed out after {e.timeout:.0f} s") from None
        except OSError as e:
            raise CompileError(src.name, src.target, cmd, "", f"could not run {self.path}: {e}") from None
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise CompileError(src.name, src.target, cmd, proc.stdout, f"exit status {proc.returncode}")
        if device_full(workdir):  # nvcc exits 0 with a truncated (still ELF) or missing cubin when the disk fills
            raise no_space_error(out_file)
        binary = out_file.read_bytes() if out_file.is_file() else b""
        if not is_valid_binary(binary, self.kind):
            raise CompileError(src.name, src.target, cmd, proc.stdout,
                               f"the compiler exited 0 but {out_file.name} is missing or not an ELF {self.kind}")
        return CompileResult(binary, self.kind, proc.stdout, seconds, tuple(cmd))


def is_valid_binary(data: bytes, kind: str) -> bool:
    """True when ``data`` looks like a loadable binary of ``kind``: an ELF file; for ``hsaco`` an AMDGPU
    (e_machine 224) shared object, for ``cubin`` a CUDA (e_machine 190) ELF."""
    if len(data) < 20 or data[:4] != b"\x7fELF":
        return False
    e_type = int.from_bytes(data[16:18], "little")
    e_machine = int.from_bytes(data[18:20], "little")
    if kind == "hsaco":
        return e_machine == 224 and e_type == 3  # EM_AMDGPU, ET_DYN
    if kind == "cubin":
        return e_machine == 190  # EM_CUDA
    return False


# ---------------------------------------------------------------------------------------------- NVRTC
def _nvrtc_module() -> Any:
    from cuda.bindings import nvrtc  # type: ignore[import-not-found]

    return nvrtc


@functools.lru_cache(maxsize=None)
def _nvrtc_info() -> tuple[str, tuple[int, ...]] | None:
    """(version, supported sm numbers) of an importable and loadable NVRTC, else None."""
    try:
        nvrtc = _nvrtc_module()
        err, major, minor = nvrtc.nvrtcVersion()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return None
        err, archs = nvrtc.nvrtcGetSupportedArchs()
        return f"{major}.{minor}", tuple(int(a) for a in archs)
    except Exception:  # not installed, or libnvrtc not loadable
        return None


def _nvrtc_compile(src: KernelSource, flags: list[str], out_file: Path) -> CompileResult:
    nvrtc = _nvrtc_module()
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    cmd = ("nvrtc", *flags)
    t0 = time.perf_counter()
    err, prog = nvrtc.nvrtcCreateProgram(src.source.encode(), f"kernel{src.ext}".encode(), 0, [], [])
    if err != ok:
        raise CompileError(src.name, src.target, cmd, "", f"nvrtcCreateProgram: {err}")
    try:
        opts = [f.encode() for f in flags]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\x00").decode(errors="replace")
        if res != ok:
            raise CompileError(src.name, src.target, cmd, log, f"nvrtcCompileProgram: {res.name}")
        err, n = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * n
        (err2,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if err != ok or err2 != ok or not is_valid_binary(cubin, "cubin"):
            raise CompileError(src.name, src.target, cmd, log, "NVRTC gave no cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    seconds = time.perf_counter() - t0
    out_file.write_bytes(cubin)
    return CompileResult(cubin, "cubin", log, seconds, cmd)


# ------------------------------------------------------------------------------------ finding compilers
@functools.lru_cache(maxsize=None)
def _version_text(path: str) -> str:
    """``<path> --version`` output (cached per process); empty when it cannot run."""
    try:
        p = subprocess.run([path, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace", timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return p.stdout if p.returncode == 0 else ""


def _nvcc_version(path: str) -> str | None:
    """``13.0.88 (cuda_13.0.r13.0/compiler.36424714_0)`` from ``nvcc --version``, or None."""
    text = _version_text(path)
    m = re.search(r"release [0-9.]+, V([0-9][0-9.]*)", text)
    if not m:
        return None
    b = re.search(r"^Build (\S+)", text, re.M)
    return m.group(1) + (f" ({b.group(1)})" if b else "")


@functools.lru_cache(maxsize=None)
def _nvcc_archs(path: str) -> tuple[str, ...]:
    """``sm_XX`` names from ``nvcc --list-gpu-code`` (cached)."""
    try:
        p = subprocess.run([path, "--list-gpu-code"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(re.findall(r"sm_[0-9]+[a-z]?", p.stdout))


def _clang_version(path: str) -> tuple[str, int] | None:
    """(first line of ``--version`` minus the program name, major) of a clang or hipcc, or None."""
    text = _version_text(path)
    m = re.search(r"^(.*?clang version ([0-9]+)\.[^\n]*)$", text, re.M)
    if not m:
        return None
    line = m.group(1).strip()
    hip = re.search(r"^HIP version:\s*(\S+)", text, re.M)
    return (f"HIP {hip.group(1)}; {line}" if hip else line), int(m.group(2))


def _clang_dir(path: str) -> Path | None:
    m = re.search(r"^InstalledDir:\s*(.+)$", _version_text(path), re.M)
    return Path(m.group(1).strip()) if m else None


@functools.lru_cache(maxsize=None)
def _amdgpu_cpus(clang: str) -> tuple[str, ...]:
    """AMDGPU processors a clang supports (``--print-supported-cpus``), cached; () when unknown."""
    try:
        p = subprocess.run([clang, "--target=amdgcn-amd-amdhsa", "-nogpulib", "--print-supported-cpus"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(re.findall(r"^\s*(gfx[0-9a-f]+)\s*$", p.stdout, re.M))


def _has_lld(clang: str) -> bool:
    d = _clang_dir(clang)
    cands = [d / "ld.lld", d / "lld"] if d else []
    return any(c.exists() for c in cands) or shutil.which("ld.lld") is not None


def _find_tool(tool: str, roots: Sequence[str], first: str | None = None) -> str | None:
    for cand in (first, shutil.which(tool), *(str(Path(h) / "bin" / tool) for h in roots)):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def find_cuda_tool(tool: str) -> str | None:
    """The CUDA toolkit's executable ``tool`` (``nvcc``, ``cuobjdump``, ``nvdisasm``...): on PATH, else in
    ``bin/`` of ``$CUDA_HOME``, ``$CUDA_PATH`` or ``/usr/local/cuda`` (:func:`ds4c.settings.cuda_roots`); for
    nvcc, ``$DS4C_NVCC`` first. None when not found."""
    return _find_tool(tool, settings.cuda_roots(), settings.nvcc() if tool == "nvcc" else None)


def _find_hipcc() -> str | None:
    return _find_tool("hipcc", settings.rocm_roots())


def _clang_candidates() -> list[str]:
    names = [settings.clang() or ""] + [f"clang-{v}" for v in range(30, MIN_CLANG_MAJOR - 1, -1)]
    names.append("clang")
    out: list[str] = []
    for n in names:
        p = shutil.which(n) if n else None
        if p and p not in out:
            out.append(p)
    return out


def _cuda_toolchain(target: Target, prefer: str | None) -> Toolchain:
    base = re.sub(r"a$", "", target.arch)
    problems: list[str] = []
    if prefer in (None, "nvcc"):
        nvcc = find_cuda_tool("nvcc")
        if nvcc:
            ver = _nvcc_version(nvcc)
            archs = _nvcc_archs(nvcc)
            if ver is None:
                problems.append(f"{nvcc} --version gave no version")
            elif archs and base not in archs:
                problems.append(f"nvcc {ver} at {nvcc} does not support {target.arch} (it supports {' '.join(archs)})")
            else:
                return Toolchain("nvcc", ver, nvcc)
        else:
            problems.append("nvcc is not on PATH (nor in $CUDA_HOME/bin or /usr/local/cuda/bin)")
    if prefer in (None, "nvrtc"):
        info = _nvrtc_info()
        if info is None:
            problems.append("NVRTC is not importable (cuda.bindings.nvrtc with libnvrtc)")
        elif int(base[3:]) not in info[1]:
            problems.append(f"NVRTC {info[0]} does not support {target.arch}")
        else:
            return Toolchain("nvrtc", info[0], None)
    raise ToolchainError(f"no CUDA compiler for {target.slug}: {'; '.join(problems)}. To fix: {_INSTALL_CUDA}")


def _hip_toolchain(target: Target, prefer: str | None) -> Toolchain:
    problems: list[str] = []
    if prefer in (None, "hipcc"):
        hipcc = _find_hipcc()
        if hipcc:
            v = _clang_version(hipcc)
            d = _clang_dir(hipcc)
            cpus = _amdgpu_cpus(str(d / "clang")) if d and (d / "clang").exists() else ()
            if v is None:
                problems.append(f"{hipcc} --version shows no clang version")
            elif cpus and target.arch not in cpus:
                problems.append(f"hipcc ({v[0]}) does not support {target.arch}")
            else:
                return Toolchain("hipcc", v[0], hipcc)
        elif prefer == "hipcc":
            problems.append("hipcc is not on PATH (nor in $ROCM_PATH/bin or /opt/rocm/bin)")
    if prefer in (None, "clang"):
        cands = _clang_candidates()
        if not cands:
            problems.append(f"no clang-{MIN_CLANG_MAJOR} (or newer) or clang on PATH")
        for c in cands:
            v = _clang_version(c)
            if v is None:
                problems.append(f"{c} --version shows no clang version")
            elif v[1] < MIN_CLANG_MAJOR:
                problems.append(f"{c} is clang {v[1]} ({v[0]}); HIP kernels need clang >= {MIN_CLANG_MAJOR}")
            elif target.arch not in _amdgpu_cpus(c):
                problems.append(f"{c} ({v[0]}) does not support {target.arch}")
            elif not _has_lld(c):
                problems.append(f"{c} has no lld beside it (ld.lld), which links the code object")
            else:
                return Toolchain("clang", v[0], c)
    raise ToolchainError(f"no HIP compiler for {target.slug}: {'; '.join(problems)}. To fix: {_INSTALL_HIP}")


def find_toolchain(target: Target, prefer: str | None = None) -> Toolchain:
    """The compiler to use for ``target``: for CUDA nvcc, else NVRTC; for HIP hipcc (if it supports the arch),
    else clang >= 19 (``$DS4C_CLANG``, ``clang-30`` ... ``clang-19``, then ``clang``). ``prefer`` names one
    toolchain (``nvcc`` | ``nvrtc`` | ``hipcc`` | ``clang``) and then only that one is tried.

    Never queries a GPU; compiler versions are read once per process.

    Raises:
        ToolchainError: ``prefer`` is not a toolchain of ``target``'s vendor, or no usable compiler is found
            (the message says what was found and what to install).
    """
    names = CUDA_TOOLCHAINS if target.vendor == "cuda" else HIP_TOOLCHAINS
    if prefer is not None and prefer not in names:
        raise ToolchainError(f"toolchain {prefer!r} cannot compile for {target.slug}: expected one of "
                             f"{', '.join(names)}")
    if target.vendor == "cuda":
        return _cuda_toolchain(target, prefer)
    return _hip_toolchain(target, prefer)


# --------------------------------------------------------------------------------------- resource usage
_PTXAS_ENTRY = re.compile(r"(?:Compiling entry function|Function properties for) '?([A-Za-z_][\w$]*)'?")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_BARRIERS = re.compile(r"used (\d+) barriers")
_HIP_REMARK = re.compile(r"remark:\s+(.*?)\s*\[-Rpass-analysis=kernel-resource-usage\]")
_HIP_KEYS = {"SGPRs": "sgprs", "VGPRs": "vgprs", "AGPRs": "agprs", "ScratchSize [bytes/lane]": "scratch_bytes",
             "Dynamic Stack": "dynamic_stack", "Occupancy [waves/SIMD]": "occupancy",
             "SGPRs Spill": "sgpr_spills", "VGPRs Spill": "vgpr_spills", "LDS Size [bytes/block]": "lds_bytes"}


def resource_usage(result: CompileResult, target: Target) -> dict[str, dict[str, Any]]:
    """Per-function resource use parsed from a compile log: ``{function: {...}}``.

    CUDA (``ptxas -v``): ``registers``, ``spill_stores`` / ``spill_loads`` (bytes), ``smem_bytes`` (static
    shared memory), ``stack_bytes`` (stack frame), ``barriers``. HIP (clang ``kernel-resource-usage``
    remarks): ``sgprs``, ``vgprs``, ``agprs``, ``sgpr_spills`` / ``vgpr_spills`` (registers), ``lds_bytes``,
    ``scratch_bytes`` (per lane), ``occupancy`` (waves per SIMD), ``dynamic_stack``; plus the common names
    ``registers`` (= VGPRs), ``smem_bytes`` (= LDS), ``stack_bytes`` (= scratch). Every entry also has
    ``spills`` (True when anything spilled). Functions the log does not mention are absent; an empty log
    gives ``{}``.
    """
    if target.vendor == "cuda":
        return _ptxas_usage(result.log)
    return _clang_usage(result.log)


def _ptxas_usage(log: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    cur: str | None = None
    for line in log.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            cur = m.group(1)
            out.setdefault(cur, {})
            continue
        if cur is None:
            continue
        d = out[cur]
        if (m := _PTXAS_FRAME.search(line)):
            d["stack_bytes"], d["spill_stores"], d["spill_loads"] = (int(g) for g in m.groups())
        if (m := _PTXAS_USED.search(line)):
            d["registers"] = int(m.group(1))
            if (s := _PTXAS_SMEM.search(line)):
                d["smem_bytes"] = int(s.group(1))
            if (b := _PTXAS_BARRIERS.search(line)):
                d["barriers"] = int(b.group(1))
    for d in out.values():
        d.setdefault("smem_bytes", 0)
        d["spills"] = bool(d.get("spill_stores", 0) or d.get("spill_loads", 0))
    return {k: v for k, v in out.items() if v.keys() - {"smem_bytes", "spills"}}


def _clang_usage(log: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    cur: str | None = None
    for line in log.splitlines():
        m = _HIP_REMARK.search(line)
        if not m:
            continue
        text = m.group(1)
        if text.startswith("Function Name:"):
            cur = text.split(":", 1)[1].strip()
            out[cur] = {}
            continue
        if cur is None or ":" not in text:
            continue
        k, v = (s.strip() for s in text.rsplit(":", 1))
        if k in _HIP_KEYS:
            out[cur][_HIP_KEYS[k]] = (v == "True") if v in ("True", "False") else (int(v) if v.isdigit() else v)
    for d in out.values():
        d["registers"] = d.get("vgprs", 0)
        d["smem_bytes"] = d.get("lds_bytes", 0)
        d["stack_bytes"] = d.get("scratch_bytes", 0)
        d["spills"] = bool(d.get("sgpr_spills", 0) or d.get("vgpr_spills", 0))
    return out
