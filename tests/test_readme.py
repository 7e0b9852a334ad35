"""The README cannot drift: its config reference is the generated text
(`python -m xpu_serve.config --reference`), its exit code table is xpu_serve/exitcodes.py, its
command table lists every subcommand, and its set-up section has the two commands."""

from __future__ import annotations

import ast
import re

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
