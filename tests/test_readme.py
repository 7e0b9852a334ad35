"""The README cannot drift: its config reference is the generated text
(`python -m xpu_serve.config --reference`), its exit code table is xpu_serve/exitcodes.py, its
command table lists every subcommand, and its set-up section has the two commands."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from tests.conftest import ROOT
from xpu_serve import exitcodes
from xpu_serve.cli import SUBCOMMANDS
from xpu_serve.config import reference

README = ROOT / "README.md"


def section(text: str, name: str) -> str:
    """The lines between `<!-- NAME:start -->` and `<!-- NAME:end -->`."""
    m = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", text, re.S)
    assert m, f"README has no {name} markers"
    return m.group(1)


def exit_code_table() -> str:
    """The exit code table, from the constants of xpu_serve/exitcodes.py and the docstring after each."""
    tree = ast.parse((ROOT / "src" / "xpu_serve" / "exitcodes.py").read_text())
    rows = ["| code | name | meaning |", "| --- | --- | --- |"]
    body = tree.body
    for node, nxt in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            doc = ""
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                doc = " ".join(str(nxt.value.value).split())
            rows.append(f"| {getattr(exitcodes, name)} | `{name}` | {doc} |")
    return "\n".join(rows) + "\n"


def test_config_reference_is_generated() -> None:
    got = section(README.read_text(), "config-reference")
    assert got == reference(), (
        "README config reference is stale: paste `python -m xpu_serve.config --reference`"
    )


def test_exit_codes_table_matches_module() -> None:
    got = section(README.read_text(), "exit-codes")
    want = exit_code_table()
    assert got == want, f"README exit codes are stale; they should read:\n{want}"
    assert "| 2 | `USAGE` |" in got


def test_commands_table_lists_every_subcommand() -> None:
    text = README.read_text()
    for name in SUBCOMMANDS:
        assert re.search(rf"^\| `xpu-serve {name}\b", text, re.M), name


def test_setup_has_the_two_commands() -> None:
    text = README.read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = [line.strip() for line in setup.splitlines() if line.startswith("    ")]
    assert commands == [
        "python3 -m venv .venv && .venv/bin/pip install -e . && "
        ".venv/bin/xpu-serve up -c configs/demo.yaml --no-echo",
        "bash scripts/test.sh",
    ]


PROOF = re.compile(r"^(?:\.venv/bin/python -m pytest|promtool test) ")


def production_commands() -> dict[str, list[str]]:
    """The README's last section, `## Production`: subsection title -> its proof commands (indented
    lines or `code spans` that run `.venv/bin/python -m pytest ...` or `promtool test ...`)."""
    text = README.read_text()
    sections = text.split("\n## ")
    assert sections[-1].startswith("Production\n"), "## Production must be the README's last section"
    found: dict[str, list[str]] = {}
    for sub in sections[-1].split("\n### ")[1:]:
        title, _, body = sub.partition("\n")
        indented = [ln.strip() for ln in body.splitlines() if ln.startswith("    ")]
        spans = re.findall(r"`([^`]+)`", " ".join(body.split()))
        found[title] = [c for c in indented + spans if PROOF.match(c)]
    return found


def test_every_production_integration_names_the_command_that_proves_it() -> None:
    found = production_commands()
    assert {"systemd", "Probes and health checks", "Prometheus alerts", "Docker", "Logs"} <= set(found)
    for title, proofs in found.items():
        assert proofs, f"### {title}: no `.venv/bin/python -m pytest ...` (or promtool test) command"
        for proof in proofs:
            for arg in proof.split()[3:]:
                if arg.startswith("-"):
                    continue
                path, _, name = arg.partition("::")
                assert (ROOT / path).is_file(), f"### {title}: {path} does not exist"
                if name:
                    assert f"def {name}(" in (ROOT / path).read_text(), f"### {title}: no test {arg}"


def _command_rows() -> dict[str, str]:
    """The README's per-command exit code table: command cell -> codes cell."""
    text = README.read_text().split("Per command (", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in text.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1]
    return rows


def test_exit_codes_per_command(tmp_path: Path, xpu_serve_cmd: list[str]) -> None:
    """Each command, run for real into the state that gives a code, exits with that code, and the
    README's row for it documents the code."""
    rt = tmp_path / "rt"
    good = tmp_path / "c.yaml"
    good.write_text(f"engine: {{model: tiny}}\nruntime_dir: {rt}\nmetrics: {{enabled: false}}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {port: x}\n")
    case = ROOT / "tests" / "fixtures" / "cases" / "b70-worker0-died-ccl" / "input.log"
    empty = tmp_path / "empty.log"
    empty.write_text("")
    kernel = tmp_path / "kernel.txt"
    kernel.write_text("[  551.424205] xe 0000:03:00.0: [drm] GT0: Engine reset: engine_class=bcs, logical_mask: 0x1, guc_id=3\n")
    quiet_kernel = tmp_path / "quiet.txt"
    quiet_kernel.write_text("[    1.000000] Linux version 6.8.0\n")
    runs: list[tuple[str, list[str], int]] = [
        ("`up`", ["up", "-c", str(bad)], 2),
        ("`status`", ["status", "-c", str(good)], 1),
        ("`status`", ["status", "-c", str(bad)], 2),
        ("`status --check`", ["status", "-c", str(good), "--check"], 2),
        ("`stop`", ["stop", "-c", str(good)], 1),
        ("`stop`", ["stop", "-c", str(bad)], 2),
        ("`check`", ["check", "-c", str(bad)], 2),
        ("`render`, `unit`", ["render", "-c", str(good)], 0),
        ("`render`, `unit`", ["unit", "-c", str(bad)], 2),
        ("`diagnose`", ["diagnose", str(case)], 0),
        ("`diagnose`", ["diagnose", str(tmp_path)], 2),
        ("`diagnose`", ["diagnose", str(empty)], 6),
        ("`bundles`", ["bundles", "-c", str(good), "list"], 0),
        ("`bundles`", ["bundles", "-c", str(good), "show", "nope"], 2),
        ("`bundle`", ["bundle", "-c", str(bad)], 2),
        ("`npd check`", ["npd", "check", "--source", "file", "--path", str(quiet_kernel)], 0),
        ("`npd check`", ["npd", "check", "--source", "file", "--path", str(kernel)], 1),
        ("`npd check`", ["npd", "check", "--source", "file", "--path", str(tmp_path / "none")], 2),
    ]
    rows = _command_rows()
    for row, argv, code in runs:
        r = subprocess.run([*xpu_serve_cmd, *argv], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == code, (argv, r.returncode, r.stdout[-500:], r.stderr[-500:])
        assert "Traceback" not in r.stderr, (argv, r.stderr)
        assert re.search(rf"(^|; ){code} ", rows[row]), (row, code, rows[row])
    assert set(rows) >= {row for row, _, _ in runs}
