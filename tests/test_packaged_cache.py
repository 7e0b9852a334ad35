"""The marshal cache of the packaged tables (yamldata.load_packaged) under a hostile
`data/__pycache__/`: every damaged or foreign cache gives the table's true values, in a real
`python` process with a bounded wait (a hang is a failure, not a stuck test run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from xpu_serve import yamldata

# Loads `rules` from the data directory argv[1] and prints its values as JSON.
_LOAD = (
    "import json, sys; from pathlib import Path; import xpu_serve.yamldata as y; "
    "y.DATA_DIR = Path(sys.argv[1]); print(json.dumps(y.load_packaged('rules')))"
)


def _load_in_process(data_dir: Path) -> object:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD, str(data_dir)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    shutil.copy(yamldata.DATA_DIR / "rules.yaml", d / "rules.yaml")
    (d / "__pycache__").mkdir()
    return d


def _truth() -> object:
    return json.loads(json.dumps(yaml.safe_load((yamldata.DATA_DIR / "rules.yaml").read_text())))


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _directory(p: Path) -> None:
    p.mkdir()


def _device(p: Path) -> None:
    p.symlink_to("/dev/zero")


def _truncated(p: Path) -> None:
    p.write_bytes(b"\xa9\x02\xda\x10")


def _random(p: Path) -> None:
    p.write_bytes(os.urandom(4096))


def _other_format(p: Path) -> None:
    p.write_bytes(b"\xff" + os.urandom(64))  # a type code this Python's marshal does not know


@pytest.mark.parametrize(
    "damage", [_fifo, _directory, _device, _truncated, _random, _other_format], ids=lambda f: f.__name__[1:]
)
def test_damaged_cache_gives_the_table(data_dir: Path, damage) -> None:
    damage(data_dir / "__pycache__" / "rules.yaml.marshal")
    assert _load_in_process(data_dir) == _truth()


def test_cache_written_then_read(data_dir: Path) -> None:
    assert _load_in_process(data_dir) == _truth()
    cache = data_dir / "__pycache__" / "rules.yaml.marshal"
    assert cache.is_file() and cache.stat().st_size > 0
    assert _load_in_process(data_dir) == _truth()


def test_stale_cache_of_an_edited_table(data_dir: Path) -> None:
    assert _load_in_process(data_dir) == _truth()
    table = data_dir / "rules.yaml"
    table.write_text(table.read_text() + "\n# edited\n")
    doc = yaml.safe_load(table.read_text())
    assert _load_in_process(data_dir) == json.loads(json.dumps(doc))
