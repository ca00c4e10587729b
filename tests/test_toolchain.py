"""Tests of the device compilers (ds4c.runtime.toolchain): flags per vendor and arch, finding a compiler (and
the errors when none fits), compiling the selftest kernel (``templates/selftest/axpy.cu.j2``) for sm_90 with
nvcc, gfx942 and gfx1151 with clang >= 19, and NVRTC when importable (each skips with a reason when its
compiler is missing), compile errors, and parsing resource use from the logs."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import pytest

from ds4c.errors import Ds4cError
from ds4c.runtime import toolchain as tcm
from ds4c.runtime.render import KernelSource, render
from ds4c.runtime.targets import target
from kernel_compile import toolchain_or_skip
from ds4c.runtime.toolchain import (CompileError, CompileResult, Toolchain, ToolchainError, find_toolchain,
                                    is_valid_binary, resource_usage)

PARAMS = {"threads": 256, "per_thread": 4}


def axpy(arch: str, **params) -> KernelSource:
    return render("selftest/axpy.cu.j2", "selftest.axpy", "selftest", target(arch), {**PARAMS, **params})


# ----------------------------------------------------------------------------------------------- flags
def test_nvcc_flags():
    tc = Toolchain("nvcc", "13.0.88", "/x/nvcc")
    f90 = tc.flags(target("sm_90"))
    assert f90[:2] == ["-cubin", "-O3"] and "-arch=sm_90" in f90
    assert f90[f90.index("-Xptxas") + 1] == "-v"
    f90a = tc.flags(target("sm_90a"))
    assert "-gencode=arch=compute_90a,code=sm_90a" in f90a and not any(x.startswith("-arch") for x in f90a)
    assert "-gencode=arch=compute_100a,code=sm_100a" in tc.flags(target("sm_100a"))
    assert tc.kind == "cubin" and tc.vendor == "cuda"


def test_nvrtc_and_clang_flags():
    assert "--gpu-architecture=sm_90" in Toolchain("nvrtc", "13.0").flags(target("sm_90"))
    tc = Toolchain("clang", "19.1.7", "/usr/bin/clang-19")
    f = tc.flags(target("gfx942"))
    for want in ("-x", "hip", "--offload-arch=gfx942", "--cuda-device-only", "-nogpuinc", "-nogpulib",
                 "--no-gpu-bundle-output", "-O3", "-Rpass-analysis=kernel-resource-usage", "-mwavefrontsize64"):
        assert want in f
    assert "-c" not in f  # device-only compile + lld link: a loadable code object, not a relocatable object
    assert "-mno-wavefrontsize64" in tc.flags(target("gfx1151"))  # wave 32 pinned, as the prelude assumes
    assert tc.kind == "hsaco" and tc.vendor == "hip"


def test_vendor_mismatch_is_an_error():
    with pytest.raises(ToolchainError, match="hip-gfx942"):
        Toolchain("nvcc", "13.0", "/x/nvcc").flags(target("gfx942"))
    with pytest.raises(ToolchainError, match="cannot compile for cuda-sm_90"):
        find_toolchain(target("sm_90"), prefer="clang")
    with pytest.raises(ToolchainError, match="unknown toolchain"):
        Toolchain("gcc", "12").flags(target("sm_90"))


# --------------------------------------------------------------------------------------- finding one
def test_no_cuda_compiler_says_what_to_install(monkeypatch):
    monkeypatch.setattr(tcm, "find_cuda_tool", lambda tool: None)
    monkeypatch.setattr(tcm, "_nvrtc_info", lambda: None)
    with pytest.raises(ToolchainError) as ei:
        find_toolchain(target("sm_90"))
    msg = str(ei.value)
    assert isinstance(ei.value, Ds4cError)
    assert "nvcc is not on PATH" in msg and "pip install cuda-bindings nvidia-cuda-nvrtc" in msg


def test_no_hip_compiler_says_what_to_install(monkeypatch):
    monkeypatch.setattr(tcm, "_find_hipcc", lambda: None)
    monkeypatch.setattr(tcm, "_clang_candidates", lambda: [])
    with pytest.raises(ToolchainError, match="apt-get install clang-19 lld-19"):
        find_toolchain(target("gfx942"))


def _fake_exe(path: Path, text: str) -> str:
    path.write_text("#!/bin/sh\ncat <<'EOF'\n" + text + "\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_old_clang_is_refused(monkeypatch, tmp_path):
    old = _fake_exe(tmp_path / "clang-17", "Ubuntu clang version 17.0.6\nTarget: x86_64-pc-linux-gnu\n"
                    f"InstalledDir: {tmp_path}")
    monkeypatch.setattr(tcm, "_find_hipcc", lambda: None)
    monkeypatch.setattr(tcm, "_clang_candidates", lambda: [old])
    with pytest.raises(ToolchainError, match=r"clang 17 .*need clang >= 19"):
        find_toolchain(target("gfx1151"))


def test_versions_are_read_once_per_process(monkeypatch):
    tc = toolchain_or_skip("gfx942")
    calls = []
    real = tcm.subprocess.run
    monkeypatch.setattr(tcm.subprocess, "run", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert find_toolchain(target("gfx942")) == tc
    assert calls == []


# ------------------------------------------------------------------------------------ real compiles
@pytest.mark.parametrize("arch", ["sm_90", "sm_90a", "gfx942", "gfx1151"])
def test_compile_selftest_kernel(arch, tmp_path):
    tc = toolchain_or_skip(arch)
    src = axpy(arch)
    res = tc.compile(src, tmp_path)
    assert res.kind == ("cubin" if arch.startswith("sm_") else "hsaco")
    assert is_valid_binary(res.binary, res.kind)
    assert (tmp_path / f"kernel.{res.kind}").read_bytes() == res.binary
    assert (tmp_path / f"kernel{src.ext}").read_text() == src.source
    assert src.entry.encode() in res.binary  # the extern "C" symbol
    assert 0 < res.seconds < 60
    use = resource_usage(res, src.target)[src.entry]
    assert use["registers"] > 0 and use["spills"] is False and use["stack_bytes"] == 0
    assert use["smem_bytes"] >= 4 * (256 // src.target.wave)  # the block reduction's scratch


def test_nvcc_log_has_ptxas_info(tmp_path):
    tc = toolchain_or_skip("sm_90", "nvcc")
    res = tc.compile(axpy("sm_90"), tmp_path)
    assert "Used" in res.log and "registers" in res.log
    assert "#177" not in res.log  # unused prelude helpers do not warn


def test_clang_gives_a_code_object_not_a_bundle(tmp_path):
    tc = toolchain_or_skip("gfx942", "clang")
    res = tc.compile(axpy("gfx942"), tmp_path)
    assert res.binary[:4] == b"\x7fELF" and b"__CLANG_OFFLOAD_BUNDLE__" not in res.binary[:64]
    assert "VGPRs:" in res.log


def test_clang_output_does_not_depend_on_the_folder(tmp_path):
    tc = toolchain_or_skip("gfx1151", "clang")
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "deeper").mkdir(parents=True)
    src = axpy("gfx1151")
    assert tc.compile(src, tmp_path / "a").binary == tc.compile(src, tmp_path / "b" / "deeper").binary


def test_compile_error_names_kernel_target_command_and_output(tmp_path):
    for arch in ("sm_90", "gfx942"):
        try:
            tc = find_toolchain(target(arch))
        except ToolchainError:
            continue
        src = axpy(arch)
        bad = dataclasses.replace(src, source=src.source + "\nthis is not C++ ds4c_marker;\n")
        with pytest.raises(CompileError) as ei:
            tc.compile(bad, tmp_path)
        e = ei.value
        assert isinstance(e, Ds4cError)
        msg = str(e)
        assert "selftest.axpy" in msg and src.target.slug in msg and "ds4c_marker" in msg
        assert e.command and e.target == src.target.slug and "error" in e.log.lower()
        if tc.path:
            assert tc.path in msg
        return
    pytest.skip("neither nvcc/NVRTC nor clang >= 19 is installed")


# --------------------------------------------------------------------------------------------- NVRTC
def _nvrtc_or_skip() -> Toolchain:
    if tcm._nvrtc_info() is None:
        pytest.skip("NVRTC is not importable here (pip install cuda-bindings nvidia-cuda-nvrtc to test it)")
    return find_toolchain(target("sm_90"), prefer="nvrtc")


def test_nvrtc_compiles_a_kernel(tmp_path):
    tc = _nvrtc_or_skip()
    src = KernelSource("selftest.plain", "selftest", target("sm_90"), "plain",
                       'extern "C" __global__ void plain(float* y, float a) { y[threadIdx.x] *= a; }')
    res = tc.compile(src, tmp_path)
    assert res.kind == "cubin" and is_valid_binary(res.binary, "cubin")
    assert resource_usage(res, src.target)["plain"]["registers"] > 0


def test_nvrtc_compiles_the_selftest_kernel(tmp_path):
    tc = _nvrtc_or_skip()
    src = axpy("sm_90")
    res = tc.compile(src, tmp_path)
    assert is_valid_binary(res.binary, "cubin")
    assert resource_usage(res, src.target)[src.entry]["registers"] > 0


# ------------------------------------------------------------------------------------ log parsing
PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for helper
    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'k1' for 'sm_90'
ptxas info    : Function properties for k1
    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem, 380 bytes cmem[0]
ptxas info    : Compile time = 5.051 ms
ptxas info    : Compiling entry function 'k2' for 'sm_90'
ptxas info    : Function properties for k2
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, 360 bytes cmem[0]
"""

CLANG_LOG = """\
kernel.hip:120:1: remark: Function Name: k1 [-Rpass-analysis=kernel-resource-usage]
kernel.hip:120:1: remark:     SGPRs: 19 [-Rpass-analysis=kernel-resource-usage]
kernel.hip:120:1: remark:     VGPRs: 129 [-Rpass-analysis=kernel-resource-usage]
kernel.hip:120:1: remark:     AGPRs: 0 [-Rpass-analysis=kernel-resource-usage]
kernel.hip:120:1: remark:     ScratchSize [bytes/lane]: 32 [-Rpass-analysis=kernel-resource-usage]
kernel.hip:120:1: remark:     Dynamic Stack: False [-Rpass-analysis=kernel-resource-usage]
kernel.hip:120:1: remark:     Occupancy [waves/SIMD]: 3 [-Rpass-analysis=kernel-resource-usage]
kernel.hip:120:1: remark:     SGPRs Spill: 0 [-Rpass-analysis=kernel-resource-usage]
kernel.hip:120:1: remark:     VGPRs Spill: 6 [-Rpass-analysis=kernel-resource-usage]
kernel.hip:120:1: remark:     LDS Size [bytes/block]: 16384 [-Rpass-analysis=kernel-resource-usage]
"""


def test_parse_ptxas_log():
    u = resource_usage(CompileResult(b"", "cubin", PTXAS_LOG, 0.0), target("sm_90"))
    assert u["k1"] == {"stack_bytes": 16, "spill_stores": 12, "spill_loads": 8, "registers": 255,
                       "barriers": 1, "smem_bytes": 4096, "spills": True}
    assert u["k2"]["registers"] == 40 and u["k2"]["smem_bytes"] == 0 and u["k2"]["spills"] is False
    assert u["helper"]["stack_bytes"] == 8
    assert resource_usage(CompileResult(b"", "cubin", "", 0.0), target("sm_90")) == {}


def test_parse_clang_remarks():
    u = resource_usage(CompileResult(b"", "hsaco", CLANG_LOG, 0.0), target("gfx942"))["k1"]
    assert u["vgprs"] == u["registers"] == 129 and u["sgprs"] == 19 and u["occupancy"] == 3
    assert u["lds_bytes"] == u["smem_bytes"] == 16384 and u["scratch_bytes"] == u["stack_bytes"] == 32
    assert u["vgpr_spills"] == 6 and u["spills"] is True and u["dynamic_stack"] is False


def test_is_valid_binary():
    elf = bytearray(64)
    elf[:4] = b"\x7fELF"
    elf[16:18] = (3).to_bytes(2, "little")
    elf[18:20] = (224).to_bytes(2, "little")
    assert is_valid_binary(bytes(elf), "hsaco") and not is_valid_binary(bytes(elf), "cubin")
    elf[18:20] = (190).to_bytes(2, "little")
    assert is_valid_binary(bytes(elf), "cubin")
    assert not is_valid_binary(b"__CLANG_OFFLOAD_BUNDLE__" + bytes(40), "hsaco")
    assert not is_valid_binary(b"", "cubin")


def test_one_cuda_toolkit_discovery(monkeypatch, tmp_path):
    """nvcc: $DS4C_NVCC, then PATH, then bin/ of $CUDA_HOME, $CUDA_PATH, /usr/local/cuda; the other CUDA tools
    (the disassemblers of ``ds4c inspect --sass``) the same way without the override."""
    from ds4c.runtime import toolchain

    def tool(folder: Path, name: str) -> str:
        folder.mkdir(parents=True, exist_ok=True)
        p = folder / name
        p.write_text("#!/bin/sh\n")
        p.chmod(0o755)
        return str(p)

    home, other, own = tool(tmp_path / "home/bin", "nvcc"), tool(tmp_path / "path/bin", "nvcc"), tool(tmp_path, "my")
    dis = tool(tmp_path / "home/bin", "nvdisasm")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "path"))
    monkeypatch.delenv("DS4C_NVCC", raising=False)
    assert toolchain.find_cuda_tool("nvcc") == home and toolchain.find_cuda_tool("nvdisasm") == dis
    monkeypatch.setenv("DS4C_NVCC", own)
    assert toolchain.find_cuda_tool("nvcc") == own and toolchain.find_cuda_tool("nvdisasm") == dis
    monkeypatch.setenv("PATH", str(tmp_path / "path/bin"))
    monkeypatch.delenv("DS4C_NVCC")
    assert toolchain.find_cuda_tool("nvcc") == other
    from ds4c.runtime import artifact_inspect

    assert artifact_inspect.find_cuda_tool is toolchain.find_cuda_tool  # inspect --sass finds its tools the same way
