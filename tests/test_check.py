"""`xpu-serve check`: real files, a real listening socket for a taken port, a fake
libze_intel_gpu.so in a temporary library directory for the known-bad driver list."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.ports import free_port as _free_port
from xpu_serve.preflight import (
    Finding,
    check_kernel_log,
    check_render_nodes,
    check_shm,
    exit_code,
    find_level_zero_gpu_libs,
    known_bad_drivers,
)

BAD_LIB = "libze_intel_gpu.so.1.14.37020"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XPU_SERVE_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    env.update(extra)
    return env


@pytest.fixture
def listening() -> Iterator[int]:
    """A real socket listening on 127.0.0.1 (a port that is taken)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        yield int(s.getsockname()[1])
    finally:
        s.close()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def _config(
    tmp_path: Path, model: Path | str, port: int, command: str | None = None, extra: str = ""
) -> Path:
    cmd = command or sys.executable
    p = tmp_path / "c.yaml"
    p.write_text(
        f"engine:\n  command: [{json.dumps(cmd)}, '-c', 'pass']\n  model: {json.dumps(str(model))}\n"
        f"  port: {port}\nmetrics: {{enabled: false}}\nruntime_dir: {json.dumps(str(tmp_path / 'rt'))}\n{extra}"
    )
    return p


def _check(
    xpu_serve_cmd: list[str], cfg: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[int, dict]:  # type: ignore[type-arg]
    r = subprocess.run(
        [*xpu_serve_cmd, "check", "-c", str(cfg), "--json", *args],
        capture_output=True,
        text=True,
        env=env or _env(),
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == r.returncode
    return r.returncode, doc


def _by_check(doc: dict, name: str) -> list[dict]:  # type: ignore[type-arg]
    return [f for f in doc["findings"] if f["check"] == name]


def test_healthy_config(xpu_serve_cmd: list[str], tmp_path: Path, model_dir: Path) -> None:
    libs = tmp_path / "libs"
    libs.mkdir()
    cfg = _config(tmp_path, model_dir, _free_port())
    code, doc = _check(xpu_serve_cmd, cfg, "--lib-dir", str(libs))
    levels = {f["level"] for f in doc["findings"]}
    assert "error" not in levels, doc
    assert code == 0
    assert _by_check(doc, "engine")[0]["level"] == "ok"
    assert _by_check(doc, "model")[0] == {
        "level": "ok",
        "check": "model",
        "message": f"{model_dir} is a model directory",
    }
    assert _by_check(doc, "port")[0]["level"] == "ok"
    assert _by_check(doc, "runtime-dir")[0]["level"] == "ok"
    assert [f["level"] for f in _by_check(doc, "driver")] == ["info"]
    # --strict turns warnings (e.g. no /dev/dri on this machine) into exit 1, and only warnings.
    code_strict, doc_strict = _check(xpu_serve_cmd, cfg, "--lib-dir", str(libs), "--strict")
    has_warning = any(f["level"] == "warning" for f in doc_strict["findings"])
    assert code_strict == (1 if has_warning else 0)


def test_text_output_one_line_per_finding(xpu_serve_cmd: list[str], tmp_path: Path, model_dir: Path) -> None:
    cfg = _config(tmp_path, model_dir, _free_port())
    r = subprocess.run(
        [*xpu_serve_cmd, "check", "-c", str(cfg), "--lib-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    lines = r.stdout.splitlines()
    assert lines and all(line.split()[0] in ("ok", "info", "warning", "error") for line in lines)
    assert any(line.startswith("ok      port ") for line in lines)
    assert r.stderr.startswith("check: 0 error(s)")
    # the messages line up: they start one column after the longest check id (e.g. "render-group")
    width = max(len(line.split()[1]) for line in lines)
    for line in lines:
        check = line.split()[1]
        assert line[8 : 8 + len(check)] == check and line[8 + len(check) : 9 + width].strip() == "", line
        assert line[9 + width] != " ", line


def test_port_taken_is_an_error(
    xpu_serve_cmd: list[str], tmp_path: Path, model_dir: Path, listening: int
) -> None:
    cfg = _config(tmp_path, model_dir, listening)
    code, doc = _check(xpu_serve_cmd, cfg, "--lib-dir", str(tmp_path))
    assert code == 2
    [port] = _by_check(doc, "port")
    assert port["level"] == "error"
    assert port["message"].startswith(f"127.0.0.1:{listening} is in use")


def test_known_bad_driver_via_lib_dir_and_env(
    xpu_serve_cmd: list[str], tmp_path: Path, model_dir: Path
) -> None:
    libs = tmp_path / "libs"
    libs.mkdir()
    real = libs / BAD_LIB
    real.write_bytes(b"\x7fELF fake")
    (libs / "libze_intel_gpu.so.1").symlink_to(BAD_LIB)
    cfg = _config(tmp_path, model_dir, _free_port())
    for args, env in (
        (["--lib-dir", str(libs)], None),
        ([], _env(XPU_SERVE_LIB_DIRS=f"/nonexistent:{libs}")),
    ):
        code, doc = _check(xpu_serve_cmd, cfg, *args, env=env)
        assert code == 2
        [drv] = _by_check(doc, "driver")  # the symlink resolves to the same file: one finding
        assert drv["level"] == "error"
        assert drv["message"].startswith(f"{real.resolve()} is a known-bad Level Zero driver:")
        assert "qwen3-30b-libze-segfault" in drv["message"]


def test_other_driver_version_is_ok(tmp_path: Path) -> None:
    (tmp_path / "libze_intel_gpu.so.1.6.32224").write_bytes(b"x")
    assert [p.name for p in find_level_zero_gpu_libs([tmp_path])] == ["libze_intel_gpu.so.1.6.32224"]
    from xpu_serve.preflight import check_driver

    assert [f.level for f in check_driver([tmp_path])] == ["ok"]


def test_known_bad_list_is_data() -> None:
    entries = known_bad_drivers()
    assert entries[0]["file"] == BAD_LIB
    assert all({"file", "symptom", "evidence", "advice"} <= set(e) for e in entries)


def test_missing_engine_and_model(xpu_serve_cmd: list[str], tmp_path: Path) -> None:
    cfg = _config(tmp_path, "/definitely/not/a/model", _free_port(), command="no-such-engine-xyz")
    code, doc = _check(xpu_serve_cmd, cfg, "--lib-dir", str(tmp_path))
    assert code == 2
    assert _by_check(doc, "engine")[0] == {
        "level": "error",
        "check": "engine",
        "message": "engine.command[0] 'no-such-engine-xyz' is not on PATH",
    }
    assert _by_check(doc, "model")[0] == {
        "level": "error",
        "check": "model",
        "message": "engine.model /definitely/not/a/model does not exist",
    }


def test_hub_id_is_info(xpu_serve_cmd: list[str], tmp_path: Path) -> None:
    cfg = _config(tmp_path, "Qwen/Qwen3-30B-A3B", _free_port())
    _, doc = _check(xpu_serve_cmd, cfg, "--lib-dir", str(tmp_path))
    assert _by_check(doc, "model")[0]["level"] == "info"


def test_affinity_mask_shorter_than_tp_warns(
    xpu_serve_cmd: list[str], tmp_path: Path, model_dir: Path
) -> None:
    cfg = _config(tmp_path, model_dir, _free_port(), extra="environment: {presets: [arc-b60-tp]}\n")
    text = cfg.read_text().replace("engine:\n", "engine:\n  tensor_parallel_size: 8\n")
    cfg.write_text(text)
    code, doc = _check(xpu_serve_cmd, cfg, "--lib-dir", str(tmp_path), "--strict")
    [aff] = _by_check(doc, "affinity")
    assert aff == {
        "level": "warning",
        "check": "affinity",
        "message": "ZE_AFFINITY_MASK=0,1,2,3 exposes 4 device(s), tensor_parallel_size is 8",
    }
    assert code in (1, 2)  # a warning under --strict (2 only if this host also has an error)


def test_render_node_permissions(tmp_path: Path) -> None:
    (tmp_path / "renderD128").write_bytes(b"")
    (tmp_path / "renderD129").write_bytes(b"")
    os.chmod(tmp_path / "renderD129", 0)
    findings = check_render_nodes(tmp_path, 4)
    assert findings[0].level == "ok" and "renderD128 readable and writable" in findings[0].message
    if os.geteuid() != 0:  # root passes every permission check
        assert findings[1].level == "error" and "renderD129: no read/write access" in findings[1].message
    assert findings[-1] == Finding("warning", "dri", "2 render node(s) for tensor_parallel_size 4")
    assert [f.level for f in check_render_nodes(tmp_path / "none", 1)] == ["warning"]


def test_shm_and_kernel_log(tmp_path: Path) -> None:
    assert check_shm(tmp_path / "missing", 4).level == "error"
    assert check_shm(tmp_path / "missing", 1).level == "warning"
    assert check_shm(tmp_path, 1).level == "ok"
    from xpu_serve.config import Config

    cfg = Config.model_validate({"engine": {"model": "m"}})
    log = tmp_path / "kmsg"
    log.write_text("6,1,0,-;hello\n")
    assert check_kernel_log(cfg, log).level == "ok"
    assert check_kernel_log(cfg, tmp_path / "absent").level == "warning"


def test_exit_code_rule() -> None:
    ok, warn, err = Finding("ok", "a", ""), Finding("warning", "b", ""), Finding("error", "c", "")
    assert exit_code([ok], strict=True) == 0
    assert exit_code([ok, warn], strict=False) == 0
    assert exit_code([ok, warn], strict=True) == 1
    assert exit_code([warn, err], strict=False) == 2


def test_render_group_missing_is_a_warning_naming_dri_access(
    xpu_serve_cmd: list[str], tmp_path: Path, model_dir: Path
) -> None:
    import grp

    from xpu_serve.preflight import check_render_group

    def no_group(name: str) -> None:
        raise KeyError(name)

    missing = check_render_group(no_group)
    assert missing.level == "warning" and missing.check == "render-group"
    assert "/dev/dri/renderD*" in missing.message and "SupplementaryGroups=" in missing.message
    assert check_render_group(lambda name: object()).level == "ok"
    # the real command on this host reports whichever it is
    try:
        grp.getgrnam("render")
        expected = "ok"
    except KeyError:
        expected = "warning"
    _, doc = _check(xpu_serve_cmd, _config(tmp_path, model_dir, _free_port()), "--lib-dir", str(tmp_path))
    assert [f["level"] for f in _by_check(doc, "render-group")] == [expected]
