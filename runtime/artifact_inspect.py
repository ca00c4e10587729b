"""What ``ds4c inspect`` reads of an artifact beyond its manifest: the binaries a kernel name designates
(:func:`find_binaries`) and their machine code (:func:`disassemble`, through the vendor's disassembler).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from ds4c.runtime.artifact_manifest import ArtifactError
from ds4c.runtime.toolchain import find_cuda_tool


def find_binaries(man: dict[str, Any], slug: str, graph: str, name: str) -> list[tuple[str, dict[str, Any]]]:
    """The binaries ``(path in the artifact, manifest record)`` that ``name`` designates for target ``slug``:
    a plan kernel of ``graph`` (e.g. ``l0.multi_gemv``: each of its launches' binaries), a rendered kernel's
    name or entry used in ``graph``, or a binary file name (with or without extension) of the target.

    Raises:
        ArtifactError: nothing matches (the message lists some names that exist).
    """
    t = man["targets"][slug]
    bins = t["binaries"]
    kernels = t["graphs"][graph]["kernels"]
    out: list[str] = []
    for k in kernels:
        if k["name"] == name:
            out += [ld["binary"] for ld in k["launches"]]
    if not out:
        for k in kernels:
            out += [ld["binary"] for ld in k["launches"] if name in (ld["kernel"], ld["entry"])]
    if not out:
        out = [rel for rel in bins if name in (Path(rel).name, Path(rel).stem)]
    if not out:
        names = [k["name"] for k in kernels]
        raise ArtifactError(f"no kernel {name!r} in graph {graph} for {slug}: plan kernels are "
                            f"{', '.join(names[:12])}{', ...' if len(names) > 12 else ''} (`ds4c inspect DIR "
                            f"--kernels` lists them)")
    return [(rel, bins[rel]) for rel in dict.fromkeys(out)]


def disassembler(kind: str, arch: str) -> tuple[list[str], str, dict[str, str] | None]:
    """``(command without the file, tool name, environment or None)`` that disassembles a binary of ``kind``
    for ``arch``.

    cubin: ``cuobjdump -sass`` (which runs ``nvdisasm``: both must be installed), else ``nvdisasm -c``;
    hsaco: ``llvm-objdump-19 -d --mcpu=ARCH`` (else another ``llvm-objdump-N``, or ``llvm-objdump``).

    Raises:
        ArtifactError: the tools are not installed (the message names what is missing and where it comes from).
    """
    if kind == "cubin":
        cuobjdump, nvdisasm = find_cuda_tool("cuobjdump"), find_cuda_tool("nvdisasm")
        if cuobjdump and nvdisasm:
            env = {**os.environ, "NVDISASM_PATH": str(Path(nvdisasm).parent)}
            return [cuobjdump, "-sass"], "cuobjdump", env
        if nvdisasm:
            return [nvdisasm, "-c"], "nvdisasm", None
        missing = "nvdisasm (cuobjdump -sass runs it)" if cuobjdump else "cuobjdump and nvdisasm"
        raise ArtifactError(f"--sass needs {missing} from the CUDA toolkit, not found on PATH (nor in "
                            f"$CUDA_HOME/bin or /usr/local/cuda/bin); pip: nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    names = ["llvm-objdump-19"] + [f"llvm-objdump-{v}" for v in range(30, 18, -1) if v != 19] + ["llvm-objdump"]
    for n in names:
        c = shutil.which(n)
        if c:
            return [c, "-d", f"--mcpu={arch}"], n, None
    raise ArtifactError("--sass needs llvm-objdump (llvm-objdump-19 or newer, or an llvm-objdump with the AMDGPU "
                        "target) to disassemble an hsaco, and none is on PATH (Debian/Ubuntu: apt-get install "
                        "llvm-19)")


def disassemble(artifact: str | os.PathLike, rel: str, record: dict[str, Any], arch: str) -> str:
    """The machine code (SASS / AMDGPU ISA) of binary ``rel`` of an artifact, as the disassembler prints it.

    Raises:
        ArtifactError: no disassembler (see :func:`disassembler`), or it failed.
    """
    cmd, tool, env = disassembler(record["kind"], arch)
    f = Path(artifact) / rel
    try:
        p = subprocess.run([*cmd, str(f)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace", timeout=300, stdin=subprocess.DEVNULL, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ArtifactError(f"{tool} could not run on {f}: {e}") from None
    if p.returncode != 0:
        tail = " | ".join(p.stdout.strip().splitlines()[-3:])
        raise ArtifactError(f"{tool} failed on {f} (exit {p.returncode}): {tail}")
    return p.stdout
