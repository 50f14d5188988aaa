"""What this machine can run: versions, device, memory, and which optimizations are available (and why not).

    caps = detect(has_mtp=config.has_mtp)
    caps.optimizations["mxfp4_kernels"].available   # False on CPU, with a reason

torch and triton are imported here, lazily, only when detect() runs.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any

OPTIMIZATIONS = ("mxfp4_kernels", "fp8_head", "mtp", "cuda_graphs", "truncated_draft_head")


@dataclass
class Availability:
    available: bool | None  # None: unknown until a model is loaded (mtp)
    reason: str | None = None  # why not, or a note on how it runs here


@dataclass
class Capabilities:
    python_version: str
    torch_version: str | None
    cuda_version: str | None  # the CUDA torch was built with
    triton_version: str | None
    triton_importable: bool
    triton_error: str | None
    cuda_available: bool
    device: str  # "cuda:0" or "cpu"
    device_name: str
    compute_capability: tuple[int, int] | None
    total_memory_bytes: int  # device memory, or host RAM on CPU
    free_memory_bytes: int
    unified_memory: bool  # GPU and CPU share one memory (GB10 / DGX Spark)
    optimizations: dict[str, Availability] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of system RAM: /proc/meminfo, else os.sysconf."""
    try:
        info: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    info[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        total = info["MemTotal"]
        avail = info.get("MemAvailable", info.get("MemFree", 0) + info.get("Cached", 0))
        return total, avail
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return 0, 0


def _nvidia_driver_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None


def available_memory_bytes() -> int:
    """Memory a model can use now: free GPU memory when CUDA is available, else available system RAM.

    Skips importing torch on machines without an NVIDIA driver, so it stays fast there."""
    if _nvidia_driver_present():
        try:
            import torch

            if torch.cuda.is_available():
                free, _total = torch.cuda.mem_get_info()
                name = torch.cuda.get_device_name()
                if _is_unified(name, torch.cuda.get_device_properties(torch.cuda.current_device())):
                    # cudaMemGetInfo on unified memory ignores reclaimable page cache; MemAvailable counts it
                    free = max(free, host_memory()[1])
                return int(free)
        except Exception:  # a broken CUDA setup must not break `sparkchat models`
            pass
    return host_memory()[1]


def is_unified_memory(device: Any) -> bool:
    """Whether `device` is a GPU sharing its memory with the CPU (GB10 / DGX Spark)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _is_unified(torch.cuda.get_device_name(index), torch.cuda.get_device_properties(index))


def _is_unified(name: str, props: Any = None) -> bool:
    return "GB10" in name or bool(getattr(props, "is_integrated", False))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def detect(has_mtp: bool | None = None) -> Capabilities:
    """Inspect this machine. `has_mtp`: whether the model to run has an MTP layer (None: not known yet)."""
    torch_version = cuda_version = None
    cuda = False
    torch_error: str | None = None
    try:
        import torch

        torch_version = torch.__version__
        cuda_version = torch.version.cuda
        cuda = torch.cuda.is_available()
    except Exception as e:  # not installed, or a broken install
        torch_error = f"PyTorch is not usable: {type(e).__name__}: {e}".splitlines()[0]

    triton_version, triton_ok, triton_error = _triton()

    cc: tuple[int, int] | None = None
    unified = False
    if cuda:
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        name = torch.cuda.get_device_name(idx)
        cc = tuple(torch.cuda.get_device_capability(idx))  # type: ignore[assignment]
        free, total = torch.cuda.mem_get_info(idx)
        unified = _is_unified(name, props)
        if unified:
            free = max(free, host_memory()[1])
        device = f"cuda:{idx}"
    else:
        name = _cpu_name()
        total, free = host_memory()
        device = "cpu"

    caps = Capabilities(
        python_version=platform.python_version(),
        torch_version=torch_version,
        cuda_version=cuda_version,
        triton_version=triton_version,
        triton_importable=triton_ok,
        triton_error=triton_error,
        cuda_available=cuda,
        device=device,
        device_name=name,
        compute_capability=cc,
        total_memory_bytes=int(total),
        free_memory_bytes=int(free),
        unified_memory=unified,
    )
    compile_error = None
    if cuda and triton_ok and cc is not None:
        from sparkchat.engine.kernels.compile_check import compile_failure

        compile_error = compile_failure(10 * cc[0] + cc[1])
    caps.optimizations = optimizations(
        cuda=cuda, compute_capability=cc, triton_ok=triton_ok, triton_error=triton_error,
        has_mtp=has_mtp, torch_error=torch_error, compile_error=compile_error,
    )
    return caps


def _triton() -> tuple[str | None, bool, str | None]:
    """(version, importable, error)."""
    version = None
    try:
        from importlib.metadata import PackageNotFoundError, version as pkg_version

        try:
            version = pkg_version("triton")
        except PackageNotFoundError:
            return None, False, "Triton is not installed (pip install 'sparkchat[cuda]')"
        import triton

        return getattr(triton, "__version__", version), True, None
    except Exception as e:
        return version, False, f"Triton does not import: {type(e).__name__}: {e}".splitlines()[0]


def optimizations(
    *,
    cuda: bool,
    compute_capability: tuple[int, int] | None,
    triton_ok: bool,
    triton_error: str | None = None,
    has_mtp: bool | None = None,
    torch_error: str | None = None,
    compile_error: str | None = None,
) -> dict[str, Availability]:
    """The availability table, from facts already gathered (pure, so it is easy to test).
    `compile_error`: why Triton cannot build kernels for this GPU (kernels.compile_check), if it cannot."""
    out: dict[str, Availability] = {}
    if torch_error:
        for key in OPTIMIZATIONS:
            out[key] = Availability(False, torch_error)
        return out

    if not cuda:
        out["mxfp4_kernels"] = Availability(False, "needs a CUDA GPU: experts run through the torch reference path")
    elif not triton_ok:
        out["mxfp4_kernels"] = Availability(False, triton_error or "needs Triton")
    elif compute_capability is not None and compute_capability < (8, 0):
        out["mxfp4_kernels"] = Availability(False, f"needs compute capability 8.0+, this GPU is "
                                                   f"{compute_capability[0]}.{compute_capability[1]}")
    elif compile_error:
        out["mxfp4_kernels"] = Availability(False, compile_error)
    else:
        out["mxfp4_kernels"] = Availability(True)

    if not cuda:
        out["fp8_head"] = Availability(True, "reference path on CPU (dequantized, no speed-up)")
    elif compute_capability is not None and compute_capability < (8, 9):
        out["fp8_head"] = Availability(True, "FP8 matmul needs compute capability 8.9+: runs dequantized")
    else:
        out["fp8_head"] = Availability(True)

    if has_mtp is None:
        out["mtp"] = Availability(None, "depends on the model: needs a checkpoint with an MTP layer")
    elif not has_mtp:
        out["mtp"] = Availability(False, "this checkpoint has no MTP layer (num_nextn_predict_layers = 0)")
    else:
        out["mtp"] = Availability(True)

    if not cuda:
        out["cuda_graphs"] = Availability(False, "needs a CUDA GPU")
    elif compile_error:  # the graphs capture the kernels' step
        out["cuda_graphs"] = Availability(False, f"CUDA graphs need the GPU kernels: {compile_error}")
    else:
        out["cuda_graphs"] = Availability(True)

    # the top-N draft head drafts through MTP, so it follows the model's MTP layer
    if has_mtp is None:
        out["truncated_draft_head"] = Availability(None, "depends on the model: drafts with the MTP layer")
    elif not has_mtp:
        out["truncated_draft_head"] = Availability(False, "this checkpoint has no MTP layer to draft with")
    elif not cuda:
        out["truncated_draft_head"] = Availability(True, "off by default on CPU (it pays where the head's "
                                                         "bytes dominate a draft step)")
    else:
        out["truncated_draft_head"] = Availability(True)
    return out
