"""Kernel GPU fault records read by a real `xpu-serve diagnose` subprocess: the process an amdgpu
fault record names (same line or the next record of the device, every layout of gmc_v9/v10/v11
and amdgpu_job.c), and the AMD IOMMU's page faults of a GPU's PCI function.

The lines are real ones from public reports (hosts kept as printed; the source of each is named),
not the fixtures the rows were first written for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def verdict(tmp_path: Path, lines: list[str]) -> dict:
    p = tmp_path / "dmesg.txt"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = subprocess.run(
        [sys.executable, "-m", "xpu_serve", "diagnose", "--json", str(p)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout, out.stderr
    return json.loads(out.stdout)


# (source, lines, pid, comm): the fault record and the record naming its process
TASK_INFO = [
    (
        "ValveSoftware/csgo-osx-linux#3298: one line, `, for process ... thread ...)` in the parentheses",
        [
            "[68752.520018] amdgpu 0000:06:00.0: amdgpu: [gfxhub0] no-retry page fault (src_id:0 ring:56 vmid:6 "
            "pasid:32784, for process cs2 pid 20579 thread VKRenderThread pid 20606)",
            "[68752.520029] amdgpu 0000:06:00.0: amdgpu:   in page starting at address 0x000080012ae97000 from IH "
            "client 0x1b (UTCL2)",
        ],
        20579,
        "cs2",
    ),
    (
        "ROCm/amdgpu#172: the next record, ` for process ... thread ... pid N)`",
        [
            "[ 4778.915423] amdgpu 0000:c6:00.0: amdgpu: [gfxhub0] no-retry page fault (src_id:0 ring:24 vmid:3 "
            "pasid:32769)",
            "[ 4778.916081] amdgpu 0000:c6:00.0: amdgpu:  for process pt_main_thread pid 12924 thread pt_main_thread "
            "pid 12924)",
            "[ 4778.916571] amdgpu 0000:c6:00.0: amdgpu:   in page starting at address 0x0000ae8570611000 from IH "
            "client 0x1b (UTCL2)",
        ],
        12924,
        "pt_main_thread",
    ),
    (
        "pop-os/cosmic-greeter#344: journald, the next record ` in process ... thread NAME:cs0 pid N)`",
        [
            "nov 04 13:30:18 odys25 kernel: amdgpu 0000:0d:00.0: amdgpu: [gfxhub] page fault (src_id:0 ring:24 "
            "vmid:3 pasid:32770)",
            "nov 04 13:30:18 odys25 kernel: amdgpu 0000:0d:00.0: amdgpu:  in process cosmic-comp pid 4732 thread "
            "cosmic-com:cs0 pid 4753)",
        ],
        4732,
        "cosmic-comp",
    ),
    (
        "getsolus/packages#7986: the next record ` Process ... thread ...` (6.8+)",
        [
            "[ 2480.727732] amdgpu 0000:0e:00.0: amdgpu: [gfxhub] page fault (src_id:0 ring:173 vmid:8 pasid:32791)",
            "[ 2480.727739] amdgpu 0000:0e:00.0: amdgpu:  Process python3 pid 15615 thread python3 pid 15615",
            "[ 2480.727745] amdgpu 0000:0e:00.0: amdgpu: GCVM_L2_PROTECTION_FAULT_STATUS:0x00841B5B",
        ],
        15615,
        "python3",
    ),
]


TASK_INFO += [
    (
        "swaywm/sway#8458: a ring timeout, then dev_err `Process information: process ...`",
        [
            "[469021.979894] amdgpu 0000:0a:00.0: amdgpu: ring gfx_0.0.0 timeout, signaled seq=198283905, emitted "
            "seq=198283907",
            "[469021.979906] amdgpu 0000:0a:00.0: amdgpu: Process information: process sway pid 10947 thread "
            "sway:cs0 pid 11020",
            "[469021.979913] amdgpu 0000:0a:00.0: amdgpu: GPU reset begin!",
        ],
        10947,
        "sway",
    ),
    (
        "yuzu-emu/yuzu#2559: syslog, DRM_ERROR `[drm:amdgpu_job_timedout [amdgpu]] *ERROR* Process information`",
        [
            "Nov 10 21:23:34 ryzen-desk kernel: [  175.106780] [drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring "
            "gfx_0.0.0 timeout, signaled seq=9910, emitted seq=9912",
            "Nov 10 21:23:34 ryzen-desk kernel: [  175.106926] [drm:amdgpu_job_timedout [amdgpu]] *ERROR* Process "
            "information: process yuzu pid 4828 thread yuzu:VulkanWork pid 4947",
            "Nov 10 21:23:34 ryzen-desk kernel: [  175.107045] amdgpu 0000:0c:00.0: amdgpu: GPU reset begin!",
        ],
        4828,
        "yuzu",
    ),
    (
        "pop-os/cosmic-epoch#3764: a ring timeout, then ` Process ... thread ...` (7.0), no `amdgpu:` tag",
        [
            "[  312.522692] amdgpu 0000:28:00.0: ring gfx_0.0.0 timeout, signaled seq=57638, emitted seq=57641",
            "[  312.522700] amdgpu 0000:28:00.0:  Process cosmic-comp pid 2288 thread cosmic-com:cs0 pid 2316",
            "[  312.522706] amdgpu 0000:28:00.0: Starting gfx_0.0.0 ring reset",
        ],
        2288,
        "cosmic-comp",
    ),
]


@pytest.mark.parametrize("source,lines,pid,comm", TASK_INFO, ids=[t[0].split(":")[0] for t in TASK_INFO])
def test_amdgpu_fault_names_its_process(
    tmp_path: Path, source: str, lines: list[str], pid: int, comm: str
) -> None:
    got = verdict(tmp_path, lines)
    assert got["cause"] == "gpu-fault", source
    assert got["root"]["pid"] == pid, source
    assert got["root"]["process"] == comm, source
    assert got["root"]["line"] == 1, source


def test_kernel_thread_fault_names_no_process(tmp_path: Path) -> None:
    """pid 0 (a kernel thread; the amdgpu-mes-msg-3-...-pid0 report's page fault) names nobody."""
    got = verdict(
        tmp_path,
        [
            "May 26 18:09:57 fedora kernel: amdgpu 0000:03:00.0: amdgpu: [gfxhub] page fault (src_id:0 ring:169 "
            "vmid:0 pasid:0, for process  pid 0 thread  pid 0)",
            "[  148.169562] [drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring sdma0 timeout, signaled seq=7276, "
            "emitted seq=7278",
            "[  148.169627] [drm:amdgpu_job_timedout [amdgpu]] *ERROR* Process information: process  pid 0 thread  "
            "pid 0",
        ],
    )
    assert got["cause"] == "gpu-fault"
    assert got["root"]["pid"] is None


def test_empty_comm_still_names_the_pid(tmp_path: Path) -> None:
    """freebsd/drm-kmod#78: FreeBSD's LinuxKPI prints an empty comm (`for process  pid 101038`)."""
    got = verdict(
        tmp_path,
        [
            "drmn0: [gfxhub0] retry page fault (src_id:0 ring:0 vmid:5 pasid:32772, for process  pid 101038 thread  "
            "pid 101038)",
            "drmn0:   in page starting at address 0x0000800104e00000 from client 27",
        ],
    )
    assert got["cause"] == "gpu-fault"
    assert got["root"]["pid"] == 101038


def test_task_info_of_another_device_is_not_taken(tmp_path: Path) -> None:
    """Two GPUs interleaved: the process record of device B does not name device A's fault."""
    got = verdict(
        tmp_path,
        [
            "[ 2480.727732] amdgpu 0000:0e:00.0: amdgpu: [gfxhub] page fault (src_id:0 ring:173 vmid:8 pasid:32791)",
            "[ 2480.727739] amdgpu 0000:0f:00.0: amdgpu:  Process python3 pid 15615 thread python3 pid 15615",
        ],
    )
    assert got["cause"] == "gpu-fault"
    assert got["root"]["pid"] is None


def test_iommu_page_fault_of_a_gpu_is_a_device_fault(tmp_path: Path) -> None:
    """ROCm/legacy-rocm-build#2820's shape from another report (swaywm/sway#8040, dmesg -T): the
    IOMMU's faults of the amdgpu function, after the rate limiter's and the overflow's records."""
    got = verdict(
        tmp_path,
        [
            "[Thu Mar 14 16:39:27 2024] amd_iommu_report_page_fault: 96 callbacks suppressed",
            "[Thu Mar 14 16:39:27 2024] AMD-Vi: IOMMU event log overflow",
            "[Thu Mar 14 16:39:27 2024] amdgpu 0000:c1:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x0005 "
            "address=0xffff0800000 flags=0x0000]",
            "[Thu Mar 14 16:39:27 2024] amdgpu 0000:c1:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x0005 "
            "address=0xffff0801000 flags=0x0000]",
        ],
    )
    assert got["cause"] == "gpu-fault"
    assert got["root"]["line"] == 3
    assert got["root"]["source"] == "kernel"


def test_iommu_page_fault_of_another_device_is_no_gpu_fault(tmp_path: Path) -> None:
    """pop-os/pop#853: the same record for an NVMe drive says nothing about the GPU."""
    got = verdict(
        tmp_path,
        [
            "[   10.919601] amd_iommu_report_page_fault: 96 callbacks suppressed",
            "[   10.919607] nvme 0000:01:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x0000 address=0xfc189000 "
            "flags=0x0000]",
            "[   10.920579] nvme 0000:01:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x0000 address=0xfbeaf000 "
            "flags=0x0000]",
        ],
    )
    assert got["cause"] == "unknown"
    assert got["root"] is None


def test_traceback_cut_inside_the_model_registry_check_is_a_config_error(tmp_path: Path) -> None:
    """tenstorrent/tt-inference-server#494's frames (vLLM's model loader resolving the checkpoint's
    architecture), the paste cut right after `raise ValueError(` in `_raise_for_unsupported`."""
    got = verdict(
        tmp_path,
        [
            '  File "/home/container_app_user/vllm/vllm/model_executor/model_loader/tt_loader.py", line 24, in '
            "load_model",
            "    model_class, _ = get_model_architecture(model_config)",
            '  File "/home/container_app_user/vllm/vllm/model_executor/model_loader/utils.py", line 35, in '
            "get_model_architecture",
            "    return ModelRegistry.resolve_model_cls(architectures)",
            '  File "/home/container_app_user/vllm/vllm/model_executor/models/registry.py", line 369, in '
            "resolve_model_cls",
            "    return self._raise_for_unsupported(architectures)",
            '  File "/home/container_app_user/vllm/vllm/model_executor/models/registry.py", line 317, in '
            "_raise_for_unsupported",
            "    raise ValueError(",
        ],
    )
    assert got["cause"] == "config-error"
    assert got["root"]["line"] == 7


def test_traceback_cut_in_other_code_is_no_config_error(tmp_path: Path) -> None:
    """The same cut in a frame that is no config check says nothing about what was raised."""
    got = verdict(
        tmp_path,
        [
            '  File "/home/container_app_user/vllm/vllm/model_executor/model_loader/utils.py", line 35, in '
            "get_model_architecture",
            "    return ModelRegistry.resolve_model_cls(architectures)",
        ],
    )
    assert got["cause"] != "config-error"


def test_sycl_runtime_without_a_gpu_is_a_config_error(tmp_path: Path) -> None:
    """oneapi-src/oneAPI-samples#1337: the SYCL device selector found no GPU (the shape of
    ggml-sycl's `can not find preferred GPU platform` in mudler/LocalAI#3437)."""
    got = verdict(
        tmp_path,
        [
            "./syc",
            "terminate called after throwing an instance of 'sycl::_V1::runtime_error'",
            "  what():  No device of requested type available. -1 (PI_ERROR_DEVICE_NOT_FOUND)",
            "Aborted (core dumped)",
        ],
    )
    assert got["cause"] == "config-error"
    assert got["root"]["line"] == 3


def test_kernel_build_rejecting_the_gpu_arch_is_a_process_exception(tmp_path: Path) -> None:
    """kyuz0/amd-strix-halo-vllm-toolboxes#73 (gfx1151, EngineCore in docker compose): AITER's
    JIT build of its sampling kernel rejects the GPU arch; the frames as posted, the exception
    line as the thread's title quotes it. A kernel library's build failing on the device, like
    "invalid device function", is a process exception, not a rejected vLLM option."""
    pre = "vllm-1  | (EngineCore pid=165) ERROR 07-02 07:48:27 [core.py:1202] "
    got = verdict(
        tmp_path,
        [
            pre + "Traceback (most recent call last):",
            pre + '  File "/opt/venv/lib64/python3.12/site-packages/aiter/ops/sampling.py", line 70, in '
            "top_k_top_p_sampling_from_probs",
            pre + "    return top_k_top_p_sampling_from_probs_core(",
            pre + '  File "/opt/venv/lib64/python3.12/site-packages/aiter_meta/csrc/cpp_itfs/sampling/'
            'top_k_top_p_sampling_from_probs.py", line 24, in compile',
            pre + "    return compile_template_op(",
            pre
            + '  File "/opt/venv/lib64/python3.12/site-packages/aiter_meta/csrc/cpp_itfs/utils.py", line 302, in '
            "compile_template_op",
            pre + "    compile_lib(src_file, folder, includes, sources, cxxflags)",
            pre + "AssertionError: One of GPU archs of ['gfx1151'] is invalid or not supported",
        ],
    )
    assert got["cause"] == "process-exception"
    assert got["root"]["process"] == "EngineCore"
    assert got["root"]["pid"] == 165
    assert got["root"]["line"] == 8


def test_an_option_vllm_rejects_for_the_device_stays_a_config_error(tmp_path: Path) -> None:
    """The same words raised by vLLM's own config check (not a kernel build; a made-up line) are a
    config error."""
    got = verdict(
        tmp_path,
        [
            "Traceback (most recent call last):",
            '  File "/usr/local/lib/python3.12/dist-packages/vllm/config/model.py", line 715, in __post_init__',
            "    self._verify_quantization()",
            "ValueError: fp8 quantization is not supported on gfx1151",
        ],
    )
    assert got["cause"] == "config-error"
