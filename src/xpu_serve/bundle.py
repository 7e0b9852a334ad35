"""The diagnostic bundle: one self-contained, redacted folder per incident.

Layout (docs/bundles.md has the full description):

    RUNTIME/bundles/<YYYYMMDDTHHMMSSZ>-i<incarnation>-<cause>/     0700, files 0600
        summary.md      the people's report, trigger and what the bundle holds
        report.txt      the people's report alone; its FILE:LINE are paths in the bundle
        incident.json   the verdict contract (cause, summary, root, ...) + "supervisor": facts
        bundle.json     manifest: complete, errors, collector outcomes, files (written last)
        logs/           RUNTIME/logs/<incarnation>/* (whole, or head+tail past log_cap_bytes)
        kernel.log      kernel records from incarnation start - look-back to now
        stacks/         <pid>-<name>.txt py-spy dumps
        env.txt config.yaml versions.txt host.txt devcoredump/
    RUNTIME/bundles/<id>.tar.gz                                    when bundles.tar is set

Who calls what:

- the supervisor: `IncidentBundle(ctx, trigger, incident, report_text, stacks)`, `begin()` in its
  capturing state before it kills anything, `collect()` while the tree is stopped, `finish(...)`
  after the stop with the verdict of the whole log -> `BundleResult`;
- recovery after a kill -9 and snapshots: `write_incident_bundle` (the three steps at once);
- `xpu-serve bundles list|show|path` -> `list_bundles`, `find_bundle`;
- `xpu-serve bundle` -> `request_bundle` (answered by `BundleRequestWatcher` inside a running
  supervisor) or `write_snapshot_bundle` standalone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import tarfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from xpu_serve import aio, procfs
from xpu_serve.collectors import (
    DEFAULT_COLLECTORS,
    DIR_MODE,
    FILE_MODE,
    BundleWriter,
    Cancelled,
    CollectInputs,
    Collector,
    CollectorOutcome,
    config_dump,
    run_collectors,
)
from xpu_serve.fsread import read_regular
from xpu_serve.incarnation import IncarnationContext, ProcessInfo, Trigger
from xpu_serve.redact import Redactor, secrets_in_argv, secrets_in_env, secrets_in_mapping

BUNDLES_DIR = "bundles"
REQUESTS_DIR = "requests"
_ID_RE = re.compile(r"^(?P<time>\d{8}T\d{6}Z)-i(?P<inc>\d+)-(?P<cause>[a-z0-9-]+?)(?:_(?P<n>\d+))?$")


@dataclass
class BundleResult:
    """What `write_incident_bundle` did.

    Attributes:
        path: the bundle folder, or None when not even the folder could be created.
        complete: True when every file and collector landed (no error, no timeout).
        errors: one line per problem ("host: cut off after 10s", "No space left on device: ...").
        cause: the cause id used in the folder name ("umd-segfault", "snapshot").
    """

    path: Path | None
    complete: bool
    errors: list[str] = field(default_factory=list)
    cause: str = "unknown"


@dataclass
class BundleInfo:
    """One bundle on disk, as `xpu-serve bundles list` shows it.

    Attributes:
        id: folder name without suffix; path: the folder (None if only the tar is left);
        tar: the .tar.gz or None; created: epoch seconds (from the id's UTC time);
        incarnation; cause; summary: one sentence; complete: from bundle.json, None while being
        written or when the writer was cut off, False when the folder is damaged whatever the
        manifest says; problem: what is damaged ("incident.json missing or unreadable",
        "bundle.json unreadable"; "" when nothing); size_bytes: folder + tar.
    """

    id: str
    path: Path | None
    tar: Path | None
    created: float
    incarnation: int
    cause: str
    summary: str = ""
    complete: bool | None = None
    size_bytes: int = 0
    problem: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path) if self.path else None
        d["tar"] = str(self.tar) if self.tar else None
        d["created_iso"] = _utc_iso(self.created)
        return d


# ----------------------------------------------------------------------------------------------
# helpers


def _utc_iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _json_default(o: Any) -> Any:
    if isinstance(o, datetime):
        return o.isoformat()
    if isinstance(o, Path):
        return str(o)
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=str)
    return str(o)


def _cause_slug(cause: Any) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", str(cause or "unknown").lower()).strip("-")
    return s[:40] or "unknown"


def _bundles_cfg(config: Any) -> Any:
    cfg = getattr(config, "bundles", None)
    if cfg is None:
        from xpu_serve.config import BundlesConfig

        cfg = BundlesConfig()
    return cfg


def config_hash(config: Any, redactor: Redactor | None = None) -> str | None:
    """"sha256:<hex>" of the config: `xpu_serve.config.config_hash(cfg)` when config.py offers it,
    else sha256 of the redacted config dumped as canonical JSON. None without a config."""
    if config is None:
        return None
    try:
        from xpu_serve import config as config_mod

        fn = getattr(config_mod, "config_hash", None)
        if fn is not None:
            h = str(fn(config))
            return h if h.startswith("sha256:") else f"sha256:{h}"
    except Exception:
        pass
    dump = (redactor or Redactor()).mapping(config_dump(config))
    data = json.dumps(dump, sort_keys=True, default=_json_default).encode()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _snapshot_processes(ctx: IncarnationContext) -> list[ProcessInfo]:
    for _ in range(5):  # the supervisor may update the dict while we copy it
        try:
            return [dataclasses.replace(p) for p in list(getattr(ctx, "processes", {}).values())]
        except RuntimeError:
            time.sleep(0.001)
    return []


def gather_secrets(config: Any, processes: list[ProcessInfo]) -> list[str]:
    """Known secret values: secret-looking keys of the config, secret-looking variables of the
    supervisor's environment and of each live process (/proc/PID/environ), and values of
    secret-looking flags in each process's argv (/proc/PID/cmdline)."""
    found = secrets_in_mapping(config_dump(config))
    found += secrets_in_env(os.environ)
    for p in processes:
        env = procfs.environ(p.pid)
        if env:
            found += secrets_in_env(env)
        argv = procfs.cmdline(p.pid)
        if argv:
            found += secrets_in_argv(argv)
            if len(argv) == 1 and " " in argv[0]:  # a process title holding the whole command line
                found += secrets_in_argv(argv[0].split())
    return found


def _trigger_dict(trigger: Trigger) -> dict[str, Any]:
    d = {k: getattr(trigger, k, None) for k in ("kind", "detail", "at", "process", "rank", "pid", "exit_code",
                                                 "signal", "detected_at", "at_source", "loop_stall_s")}
    d["at_iso"] = _utc_iso(trigger.at) if trigger.at else None
    ev = getattr(trigger, "event", None)
    if ev is not None:
        d["event"] = {k: getattr(ev, k, None) for k in ("source", "text", "time_text", "process", "rank", "pid",
                                                       "file", "line", "signature", "cause")}
    return d


def _restarts(ctx: Any, runtime_dir: Path) -> int | None:
    r = getattr(ctx, "restarts", None)
    if isinstance(r, int):
        return r
    try:
        state = json.loads((runtime_dir / "state.json").read_text())
        v = state.get("restarts")
        return int(v) if v is not None else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


# ----------------------------------------------------------------------------------------------
# writing


@dataclass
class _Run:
    """Shared between the caller and the writer thread (the caller may give up on the thread)."""

    cause: str
    path: Path | None = None
    errors: list[str] = field(default_factory=list)
    complete: bool = False
    done: bool = False
    recovered: bool = False  # written by the next `up` after a kill -9 mid-capture (xpu_serve.recovery)
    abandon: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, msg: str) -> None:
        with self.lock:
            self.errors.append(msg)


def write_incident_bundle(
    ctx: IncarnationContext,
    trigger: Trigger,
    incident: dict[str, Any],
    report_text: str,
    stacks: dict[int, str] | None = None,
    into: Path | None = None,
) -> BundleResult:
    """Write the diagnostic bundle of one incident; the supervisor calls it before killing anything.

    Args:
        ctx: the failed incarnation (its config, runtime_dir, processes, start/ready times; a
            `restarts` attribute is used when present, else RUNTIME/state.json).
        trigger: why the incarnation failed.
        incident: the verdict contract dict (`xpu_serve.diagnosis.Incident.to_contract()`,
            /work/shared/cases/README.md); its "cause" names the folder.
        report_text: the people's report (what `xpu-serve diagnose` prints) for summary.md.
        stacks: pid -> `py-spy dump` text taken before the call (the hang watchdog's
            `collectors.dump_stacks`); None lets the bundle dump live processes itself for hang,
            stall and operator triggers.
        into: an existing bundle folder to write (the one a cut capture began), else a new one.

    Returns: `BundleResult(path, complete, errors, cause)`.

    Never raises (a full disk, a read-only runtime directory or a collector's bug end up in
    `errors` with `complete=False`). Blocking: returns within about
    2 x `bundles.collector_timeout_s` + 5 s (collectors run in parallel under one timeout, then
    the optional tar under another); call it with `asyncio.to_thread` from the event loop.
    Old bundles are pruned afterwards (`bundles.keep`, `bundles.max_bytes`), never this one.
    """
    try:
        return write_bundle(ctx, trigger, incident, report_text, stacks, into=into)
    except BaseException as e:  # the supervisor must go on whatever happens here
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return BundleResult(None, False, [f"bundle writer failed: {type(e).__name__}: {e}"],
                            _cause_slug((incident or {}).get("cause") if isinstance(incident, dict) else None))


def write_bundle(
    ctx: IncarnationContext,
    trigger: Trigger,
    incident: dict[str, Any],
    report_text: str,
    stacks: dict[int, str] | None = None,
    *,
    collectors: list[tuple[str, Collector]] | None = None,
    cause: str | None = None,
    kmsg_path: Path | None = None,
    sysfs_drm: Path | None = None,
    prune: bool = True,
    into: Path | None = None,
) -> BundleResult:
    """`write_incident_bundle` with the parts that are fixed in production made explicit:
    `collectors` (default `collectors.DEFAULT_COLLECTORS`), `cause` for the folder name (default
    incident["cause"]), the kernel log device and the DRM sysfs root, and whether to prune.
    Same return value and guarantees (never raises, bounded in time): the three steps of
    `IncidentBundle` in one go."""
    job = IncidentBundle(ctx, trigger, incident, report_text, stacks, collectors=collectors, cause=cause,
                         kmsg_path=kmsg_path, sysfs_drm=sysfs_drm, into=into)
    timeout_s = float(job.bcfg.collector_timeout_s)

    def steps() -> None:
        if job.open_bundle():
            job.collect_parts()
            job.finish_parts(None, None, prune)

    return job.bounded(steps, 2 * timeout_s + 5.0)


class IncidentBundle:
    """One bundle written in three steps, so the supervisor stops the tree while it is written:

    1. `begin()`, before anything is killed: the folder, incident.json, summary.md and report.txt
       (the verdict first: the most valuable part if the disk fills up), the secrets of the live
       processes and what only the live tree can give (`CollectInputs.capture_live`: /proc facts,
       /dev/shm, the kernel ring buffer, stacks for a hang);
    2. `collect()`, while or after the tree is stopped: every collector but those of
       `AFTER_STOP` (they read the captured snapshot, not the dying tree);
    3. `finish(incident, report_text)`, once the tree is stopped and its log closed: the verdict
       files again with the verdict recomputed from the whole log, the logs collector (everything
       the incarnation wrote, its fallout included), the contents table, bundle.json (written
       last: it says the bundle is complete), the optional tar, retention.

    Each step blocks (call it with `asyncio.to_thread`), never raises (problems end up in the
    result's `errors`) and is bounded: `begin` and `collect` by about `collector_timeout_s` + 5 s,
    `finish` by 2 x `collector_timeout_s` + 5 s; a step past its bound is abandoned.
    """

    def __init__(
        self,
        ctx: IncarnationContext,
        trigger: Trigger,
        incident: dict[str, Any],
        report_text: str,
        stacks: dict[int, str] | None = None,
        *,
        collectors: list[tuple[str, Collector]] | None = None,
        cause: str | None = None,
        kmsg_path: Path | None = None,
        sysfs_drm: Path | None = None,
        into: Path | None = None,
        on_open: Callable[[Path], None] | None = None,
    ):
        self.ctx, self.trigger, self.report_text = ctx, trigger, report_text
        self.incident = dict(incident) if isinstance(incident, dict) else {"cause": "unknown", "summary": str(incident)}
        self.config: Any = getattr(ctx, "config", None)
        self.bcfg = _bundles_cfg(self.config)
        self.collectors = collectors if collectors is not None else DEFAULT_COLLECTORS
        self.run = _Run(cause=_cause_slug(cause or self.incident.get("cause")))
        self.run.recovered = self.incident.get("recovered") is True
        self._stacks, self._roots, self._into = stacks, (kmsg_path, sysfs_drm), into
        self._on_open = on_open  # told the folder as soon as it exists (the recovery marker)
        self.writer: BundleWriter | None = None
        self.inputs: CollectInputs | None = None
        self.facts: dict[str, Any] = {}
        self.outcomes: dict[str, CollectorOutcome] = {}

    # ---- the steps (each bounded, never raising) ----------------------------------------------

    def begin(self) -> BundleResult:
        """Step 1 (before the stop); the result's path is None when no folder could be made."""
        return self.bounded(self.open_bundle, float(self.bcfg.collector_timeout_s) + 5.0)

    def collect(self) -> BundleResult:
        """Step 2: the collectors that do not need the stopped tree."""
        return self.bounded(self.collect_parts, float(self.bcfg.collector_timeout_s) + 5.0)

    def finish(self, incident: dict[str, Any] | None, report_text: str | None, prune: bool = True) -> BundleResult:
        """Step 3 (after the stop): `incident`/`report_text` replace the first verdict when given."""
        return self.bounded(lambda: self.finish_parts(incident, report_text, prune),
                            2 * float(self.bcfg.collector_timeout_s) + 5.0)

    def bounded(self, fn: Any, limit_s: float) -> BundleResult:
        """Run `fn` in a daemon thread for at most `limit_s`; past it the bundle is abandoned."""
        run = self.run
        with run.lock:
            run.done = False
        t = threading.Thread(target=_guarded, args=(run, fn), name="bundle-writer", daemon=True)
        t.start()
        t.join(timeout=limit_s)
        with run.lock:
            if not run.done:
                run.abandon.set()
                run.errors.append(f"bundle writer cut off after {limit_s:g}s; the bundle may lack files")
                run.complete = False
            return BundleResult(run.path, run.complete and not run.errors, list(run.errors), run.cause)

    # ---- what the steps do ------------------------------------------------------------------------

    def open_bundle(self) -> bool:
        """Step 1's work; False when no folder could be made (nothing more can be written)."""
        run, ctx, now = self.run, self.ctx, time.time()
        rd: Any = getattr(ctx, "runtime_dir", None) or getattr(self.config, "runtime_dir", None) or "."
        runtime_dir = Path(rd)
        incarnation = int(getattr(ctx, "incarnation", 0) or 0)
        processes = _snapshot_processes(ctx)
        redactor = Redactor(gather_secrets(self.config, processes))
        base = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + f"-i{incarnation}-{run.cause}"
        self.bundles_dir = runtime_dir / BUNDLES_DIR
        try:
            path = self._into if self._into is not None else _make_bundle_dir(self.bundles_dir, base)
        except OSError as e:
            run.error(f"cannot create a bundle under {self.bundles_dir}: {e.strerror or e}")
            return False
        run.path = path
        if self._on_open is not None:
            self._on_open(path)
        self.writer = BundleWriter(path, redactor)
        self.facts = _facts(ctx, path.name, now, incarnation, self.trigger, processes, runtime_dir,
                            config_hash(self.config, redactor))
        self._write_verdict()
        self.inputs = self._inputs(runtime_dir, incarnation, processes, now)
        self.inputs.capture_live(float(self.bcfg.collector_timeout_s))
        return True

    def collect_parts(self) -> None:
        """Step 2's work."""
        self._run_collectors([c for c in self.collectors if c[0] not in AFTER_STOP])

    def finish_parts(self, incident: dict[str, Any] | None, report_text: str | None, prune: bool) -> None:
        """Step 3's work."""
        run, writer = self.run, self.writer
        if writer is None or self.inputs is None or run.path is None or run.abandon.is_set():
            return
        if incident is not None:
            self.incident = dict(incident)
            self.inputs.incident = self.incident
            self.report_text = report_text if report_text is not None else self.report_text
            self._write_verdict()
        self._run_collectors([c for c in self.collectors if c[0] in AFTER_STOP])
        if run.abandon.is_set():
            return
        outcomes = [self.outcomes[n] for n, _ in self.collectors if n in self.outcomes]
        summary = _summary(run.path.name, self.incident, self.trigger, self.facts, self.report_text)
        _try(run, "summary.md", lambda: writer.write_text("summary.md", summary + _contents_table(outcomes),
                                                           run.abandon))
        tar_path = self.bundles_dir / f"{run.path.name}.tar.gz" if self.bcfg.tar else None
        _write_manifest(run, writer, run.path, outcomes, tar_path=None, redactor=writer.redactor)
        if tar_path is not None:
            timeout_s = float(self.bcfg.collector_timeout_s)
            _try(run, "tar", lambda: _make_tar(run.path, tar_path, time.monotonic() + timeout_s, run.abandon))
            _write_manifest(run, writer, run.path, outcomes, tar_path=tar_path if tar_path.exists() else None,
                            redactor=writer.redactor)
        with run.lock:
            run.complete = not run.errors
        if prune:
            self._prune()

    def _write_verdict(self) -> None:
        """incident.json (the verdict with the supervisor's facts), summary.md, report.txt."""
        run, writer = self.run, self.writer
        assert writer is not None and run.path is not None
        prior = self.incident.get("supervisor")
        # the supervisor may already have put its own facts here: keep them, ours fill in and win
        doc = {**self.incident, "supervisor": {**(prior if isinstance(prior, dict) else {}), **self.facts}}
        _try(run, "incident.json", lambda: writer.write_text(
            "incident.json", json.dumps(doc, indent=2, default=_json_default) + "\n", run.abandon))
        head = _summary(run.path.name, self.incident, self.trigger, self.facts, self.report_text)
        _try(run, "summary.md", lambda: writer.write_text("summary.md", head, run.abandon))
        _try(run, "report.txt", lambda: writer.write_text("report.txt", self.report_text, run.abandon))

    def _inputs(self, runtime_dir: Path, incarnation: int, processes: list[ProcessInfo], now: float) -> CollectInputs:
        config, ctx, trigger = self.config, self.ctx, self.trigger
        stacks = self._stacks
        if stacks is None:  # the hang watchdog leaves them on the context or on the trigger's event
            stacks = getattr(ctx, "stacks", None) or getattr(getattr(trigger, "event", None), "extra", {}).get("stacks")
            if not isinstance(stacks, dict):
                stacks = None
        lookback = 60.0
        with contextlib.suppress(AttributeError):
            lookback = float(config.watchers.kernel.lookback_s)
        engine_cmd = None
        with contextlib.suppress(AttributeError):
            engine_cmd = list(config.engine.command)
        inputs = CollectInputs(
            incarnation=incarnation,
            runtime_dir=runtime_dir,
            started_at=self.facts["started_at"] or now,
            ready_at=self.facts["ready_at"],
            processes=processes,
            trigger=trigger,
            config=config,
            log_cap_bytes=int(self.bcfg.log_cap_bytes),
            kernel_lookback_s=lookback,
            release_devcoredump=bool(self.bcfg.release_devcoredump),
            engine_command=engine_cmd,
            stacks=stacks,
            incident=self.incident,
        )
        log_dir = getattr(ctx, "log_dir", None)
        if log_dir:
            inputs.log_dir = Path(log_dir)
        kmsg_path, sysfs_drm = self._roots
        if kmsg_path is not None:
            inputs.kmsg_path = kmsg_path
        if sysfs_drm is not None:
            inputs.sysfs_drm = sysfs_drm
        return inputs

    def _run_collectors(self, which: list[tuple[str, Collector]]) -> None:
        if not which or self.writer is None or self.inputs is None or self.run.abandon.is_set():
            return
        for o in run_collectors(which, self.inputs, self.writer, float(self.bcfg.collector_timeout_s)):
            self.outcomes[o.name] = o
            if o.status != "ok":
                self.run.error(f"{o.name}: {o.error or o.status}")

    def _prune(self) -> None:
        run = self.run
        assert run.path is not None
        try:
            _removed, errs = prune_bundles(self.bundles_dir, int(self.bcfg.keep), int(self.bcfg.max_bytes),
                                           protect={run.path.name})
            for err in errs:
                run.error(f"retention: {err}")
        except Exception as e:
            run.error(f"retention: {type(e).__name__}: {e}")


# Collectors whose evidence is complete only once the tree is stopped: the incarnation's logs
# (the fallout of a death, e.g. EngineDeadError on every request, is written after it).
AFTER_STOP = frozenset({"logs"})


def _guarded(run: _Run, fn: Any) -> None:
    try:
        fn()
    except Exception as e:
        run.error(f"bundle writer failed: {type(e).__name__}: {e}")
        run.complete = False
    finally:
        with run.lock:
            run.done = True


def _make_bundle_dir(bundles_dir: Path, base: str) -> Path:
    bundles_dir.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    with contextlib.suppress(OSError):
        os.chmod(bundles_dir, DIR_MODE)
    for n in range(1, 1000):
        p = bundles_dir / (base if n == 1 else f"{base}_{n}")
        if (bundles_dir / f"{p.name}.tar.gz").exists():
            continue
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(p, DIR_MODE)
        return p
    raise FileExistsError(f"{bundles_dir}/{base}: too many bundles with this name")


def _facts(
    ctx: Any, bundle_id: str, now: float, incarnation: int, trigger: Trigger, processes: list[ProcessInfo],
    runtime_dir: Path, chash: str | None,
) -> dict[str, Any]:
    """incident.json's "supervisor" facts: the bundle, the trigger, the processes, the times."""
    config = getattr(ctx, "config", None)
    started = float(getattr(ctx, "started_at", 0.0) or 0.0) or None
    ready = getattr(ctx, "ready_at", None)
    failed = trigger.at or now
    return {
        "bundle_id": bundle_id,
        "created_at": _utc_iso(now),
        "created_epoch": now,
        "incarnation": incarnation,
        "trigger": _trigger_dict(trigger),
        "processes": [
            {**dataclasses.asdict(p), "started_at_iso": _utc_iso(p.started_at) if p.started_at else None}
            for p in processes
        ],
        "started_at": started,
        "ready_at": ready,
        "failed_at": failed,
        "durations_s": {
            "start_to_ready": round(ready - started, 3) if ready and started else None,
            "ready_to_failure": round(failed - ready, 3) if ready else None,
            "start_to_failure": round(failed - started, 3) if started else None,
        },
        "restarts": _restarts(ctx, runtime_dir),
        "config_hash": chash,
        "config_source": str(getattr(config, "source_path", None) or "") or None,
    }


def _try(run: _Run, what: str, fn: Any) -> None:
    try:
        fn()
    except Cancelled:
        run.error(f"{what}: cut off")
    except OSError as e:
        run.error(f"{what}: {e.strerror or e}")


def _write_manifest(
    run: _Run, writer: BundleWriter, path: Path, outcomes: list[CollectorOutcome], tar_path: Path | None,
    redactor: Redactor,
) -> None:
    files = []
    for dirpath, _dirs, names in os.walk(path):
        for n in sorted(names):
            p = Path(dirpath) / n
            if p.name == "bundle.json" and p.parent == path:
                continue
            with contextlib.suppress(OSError):
                files.append({"path": str(p.relative_to(path)), "bytes": p.stat().st_size})
    with run.lock:
        errors = list(run.errors)
    manifest = {
        "id": path.name,
        "complete": not errors,
        "errors": errors,
        "collectors": [o.to_dict() for o in outcomes],
        "files": sorted(files, key=lambda f: str(f["path"])),
        "tar": tar_path.name if tar_path else None,
        "redaction": {"mask": "***", "values_known": len(redactor.secrets)},
    }
    if run.recovered:
        manifest["recovered"] = True
    _try(run, "bundle.json", lambda: writer.write_text(
        "bundle.json", json.dumps(manifest, indent=2) + "\n", run.abandon))


def _summary(bid: str, incident: dict[str, Any], trigger: Trigger, facts: dict[str, Any], report: str) -> str:
    d = facts["durations_s"]
    end = "snapshot" if trigger.kind == "operator" else "failure"  # (an operator's `xpu-serve bundle`)
    lines = [
        f"# xpu-serve bundle {bid}",
        "",
        f"- cause: **{incident.get('cause', 'unknown')}**: {incident.get('summary') or ''}".rstrip(),
        f"- trigger: {trigger.kind}: {trigger.detail} (at {facts['trigger']['at_iso']})",
        f"- incarnation {facts['incarnation']}, restarts before it: {facts['restarts'] if facts['restarts'] is not None else 'unknown'}",
        f"- start to ready: {d['start_to_ready']} s; ready to {end}: {d['ready_to_failure']} s; "
        f"start to {end}: {d['start_to_failure']} s",
        f"- config: {facts['config_hash'] or 'not available'}",
        "",
        "## Report",
        "",
        "```",
        (report or "(no report)").rstrip("\n"),
        "```",
        "",
        "",
    ]
    return "\n".join(lines)


def _contents_table(outcomes: list[CollectorOutcome]) -> str:
    rows = ["## What this bundle holds", "", "| collector | status | seconds | notes |", "| --- | --- | --- | --- |"]
    for o in outcomes:
        notes = "; ".join(([o.error] if o.error else []) + o.notes).replace("|", "/")
        rows.append(f"| {o.name} | {o.status} | {o.seconds:.2f} | {notes} |")
    return "\n".join(rows) + "\n"


class _CancellableReader:
    """A file reader for tarfile that stops (raises Cancelled) at a deadline or when abandoned."""

    def __init__(self, path: Path, deadline: float, abandon: threading.Event):
        self._f = open(path, "rb")  # noqa: SIM115 - closed by _make_tar
        self._deadline = deadline
        self._abandon = abandon

    def read(self, n: int = -1) -> bytes:
        if self._abandon.is_set() or time.monotonic() > self._deadline:
            raise Cancelled("tar")
        return self._f.read(n)

    def close(self) -> None:
        self._f.close()


def _make_tar(src: Path, dest: Path, deadline: float, abandon: threading.Event) -> None:
    """<id>.tar.gz of the bundle folder (members 0600/0700, owner 0): written to a hidden
    temporary name and renamed when whole, removed when cut off or on error."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz", compresslevel=3) as tar:
            for dirpath, dirs, names in os.walk(src):
                dirs.sort()
                rel_dir = Path(src.name) / Path(dirpath).relative_to(src)
                ti = tarfile.TarInfo(str(rel_dir).rstrip("/."))
                ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, DIR_MODE, int(time.time())
                tar.addfile(ti)
                for n in sorted(names):
                    p = Path(dirpath) / n
                    st = p.stat()
                    ti = tarfile.TarInfo(str(rel_dir / n))
                    ti.size, ti.mode, ti.mtime = st.st_size, FILE_MODE, int(st.st_mtime)
                    r = _CancellableReader(p, deadline, abandon)
                    try:
                        tar.addfile(ti, r)  # type: ignore[arg-type]
                    finally:
                        r.close()
        os.replace(tmp, dest)
        os.chmod(dest, FILE_MODE)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


# ----------------------------------------------------------------------------------------------
# listing and retention


# bundle.json, incident.json and summary.md are small; a bigger one is not a bundle's to read
BUNDLE_META_CAP_BYTES = 4 << 20


def read_bundle_file(folder: Path, name: str, cap: int = BUNDLE_META_CAP_BYTES) -> bytes | None:
    """The first `cap` bytes of a regular file in a bundle folder, never through a symlink (a
    bundle copied from elsewhere may carry one to /etc/shadow or /dev/zero); None when it is
    missing, unreadable, a symlink or not a regular file."""
    return read_regular(folder / name, cap, follow=False)


def _json_dict(raw: bytes | None) -> dict[str, Any]:
    try:
        data = json.loads((raw or b"").decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _tree_size(p: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(p):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_size
    return total


def scan_bundles(bundles_dir: Path) -> list[BundleInfo]:
    """Bundles in a `bundles/` folder (folders and `.tar.gz` files named `<UTC time>-i<N>-<cause>`),
    oldest first. Reads incident.json and bundle.json for cause, summary and completeness."""
    found: dict[str, BundleInfo] = {}
    try:
        entries = list(os.scandir(bundles_dir))
    except OSError:
        return []
    for e in entries:
        name = e.name
        is_tar = name.endswith(".tar.gz") and e.is_file(follow_symlinks=False)
        bid = name[: -len(".tar.gz")] if is_tar else name
        m = _ID_RE.match(bid)
        if not m or (not is_tar and not e.is_dir(follow_symlinks=False)):
            continue
        info = found.get(bid)
        if info is None:
            created = datetime.strptime(m.group("time"), "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc).timestamp()
            info = BundleInfo(bid, None, None, created, int(m.group("inc")), m.group("cause"))
            found[bid] = info
        if is_tar:
            info.tar = Path(e.path)
            with contextlib.suppress(OSError):
                info.size_bytes += e.stat(follow_symlinks=False).st_size
        else:
            info.path = Path(e.path)
            info.size_bytes += _tree_size(info.path)
            inc = _json_dict(read_bundle_file(info.path, "incident.json"))
            info.summary = str(inc.get("summary") or "")
            sup = inc.get("supervisor")
            precise = sup.get("created_epoch") if isinstance(sup, dict) else None
            if isinstance(precise, (int, float)) and abs(precise - info.created) < 1.0:
                info.created = float(precise)  # orders bundles taken within one second
            raw_man = read_bundle_file(info.path, "bundle.json")
            man = _json_dict(raw_man)
            done = man.get("complete")
            info.complete = done if isinstance(done, bool) else None
            # a manifest that says "complete" is not believed for a folder whose parts are gone or
            # garbage (a copy cut short, a hand edit, a disk error): `bundles list` said "yes" for
            # a bundle with no incident.json
            # (only once the manifest exists: before that the writer may still be at work)
            damage = []
            if raw_man is not None and not isinstance(done, bool):
                damage.append("bundle.json unreadable")
            if raw_man is not None and not inc:
                damage.append("incident.json missing or unreadable")
            if damage:
                info.complete = False
                info.problem = "; ".join(damage)
    return sorted(found.values(), key=_sort_key)


def _sort_key(b: BundleInfo) -> tuple[str, float, int, str]:
    m = _ID_RE.match(b.id)
    if not m:
        return (b.id, b.created, 0, b.id)
    return (m.group("time"), b.created, int(m.group("n") or 1), b.id)


def list_bundles(runtime_dir: Path | str) -> list[BundleInfo]:
    """Bundles under RUNTIME/bundles, oldest first (empty when there is none or no folder)."""
    return scan_bundles(Path(runtime_dir) / BUNDLES_DIR)


def find_bundle(runtime_dir: Path | str, ref: str) -> BundleInfo:
    """The bundle named `ref`: a full id, a unique prefix, a unique substring, or "latest".

    Raises: LookupError with a one-line message (no bundle, or ambiguous: names the candidates).
    """
    bundles = list_bundles(runtime_dir)
    if not bundles:
        raise LookupError(f"no bundles under {Path(runtime_dir) / BUNDLES_DIR}")
    if ref in ("latest", "last"):
        return bundles[-1]
    for b in bundles:
        if b.id == ref or (b.path is not None and str(b.path) == ref):
            return b
    cands = [b for b in bundles if b.id.startswith(ref)] or [b for b in bundles if ref in b.id]
    if len(cands) == 1:
        return cands[0]
    if not cands:
        raise LookupError(f"no bundle matches {ref!r} under {Path(runtime_dir) / BUNDLES_DIR}")
    raise LookupError(f"{ref!r} matches {len(cands)} bundles: " + ", ".join(b.id for b in cands[:5]))


def prune_bundles(
    bundles_dir: Path, keep: int, max_bytes: int, protect: set[str] | None = None
) -> tuple[list[str], list[str]]:
    """Retention: remove the oldest bundles (folder and tar together) until at most `keep` remain
    and they take at most `max_bytes` bytes. The newest bundle and those in `protect` are never
    removed, even when they alone exceed `max_bytes`.

    Returns (removed ids, errors). Never raises for a bundle that cannot be removed.
    """
    bundles = scan_bundles(bundles_dir)
    if not bundles:
        return [], []
    keepers = set(protect or ()) | {bundles[-1].id}
    removed: list[str] = []
    errors: list[str] = []
    live = list(bundles)

    def remove_oldest() -> bool:
        for b in live:
            if b.id in keepers:
                continue
            for p in (b.path, b.tar):
                if p is None:
                    continue
                try:
                    if p.is_dir():
                        shutil.rmtree(p)
                    else:
                        p.unlink()
                except OSError as e:
                    errors.append(f"cannot remove {p}: {e.strerror}")
            live.remove(b)
            removed.append(b.id)
            return True
        return False

    while len(live) > keep and remove_oldest():
        pass
    while sum(b.size_bytes for b in live) > max_bytes and remove_oldest():
        pass
    return removed, errors


# ----------------------------------------------------------------------------------------------
# operator snapshots: `xpu-serve bundle`


SNAPSHOT_CAUSE = "snapshot"


def snapshot_incident(note: str | None = None) -> dict[str, Any]:
    """The verdict dict of an operator snapshot: no failure was declared, so cause "unknown"."""
    return {
        "cause": "unknown",
        "summary": "Operator snapshot taken with `xpu-serve bundle`; no failure was declared.",
        "root": None,
        "consequences": [],
        "timeline": [],
        "hang": None,
        "library": None,
        "notes": [n for n in ["taken on request while the server was running", note] if n],
    }


def write_snapshot_bundle(ctx: IncarnationContext, note: str | None = None) -> BundleResult:
    """An operator's snapshot of the running incarnation (trigger kind "operator", folder cause
    "snapshot"; live processes get a `py-spy dump`). Never raises; bounded like
    `write_incident_bundle`."""
    trig = Trigger(kind="operator", detail=f"operator snapshot (xpu-serve bundle){': ' + note if note else ''}",
                   at=time.time())
    try:
        return write_bundle(ctx, trig, snapshot_incident(note), "Operator snapshot: no incident.\n",
                            None, cause=SNAPSHOT_CAUSE)
    except Exception as e:
        return BundleResult(None, False, [f"bundle writer failed: {type(e).__name__}: {e}"], SNAPSHOT_CAUSE)


# Seconds between the bundle-request watcher's fallback scans (requests normally come with SIGUSR1).
SLOW_SCAN_S = 10.0


def request_bundle(runtime_dir: Path | str, note: str | None = None) -> Path:
    """Drop a snapshot request for a running supervisor: RUNTIME/requests/bundle-<id>.json.

    The supervisor's `BundleRequestWatcher` renames it to `.taken` when it starts and writes
    `bundle-<id>.done.json` ({path, complete, errors, cause}) when the bundle is written.
    Returns the request file's path. Raises OSError when the folder is not writable.
    """
    req_dir = Path(runtime_dir) / REQUESTS_DIR
    req_dir.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    rid = uuid.uuid4().hex[:12]
    path = req_dir / f"bundle-{rid}.json"
    tmp = req_dir / f".bundle-{rid}.tmp"
    tmp.write_text(json.dumps({"id": rid, "requested_at": time.time(), "pid": os.getpid(), "note": note}))
    os.replace(tmp, path)
    return path


def _answer_path(request: Path, suffix: str) -> Path:
    return request.with_name(request.name[: -len(".json")] + suffix)


def serve_bundle_request(ctx: IncarnationContext, request: Path) -> BundleResult | None:
    """Answer one request file: take it (rename to .taken; None when another took it first),
    write the snapshot bundle, write `<request>.done.json`. Never raises."""
    taken = _answer_path(request, ".taken")
    try:
        # only a regular file is a request (`request_bundle` writes one): reading a FIFO dropped
        # here would block this thread forever, and with it every later request of the
        # incarnation and one worker of the event loop's default executor
        if not stat.S_ISREG(os.lstat(request).st_mode):
            return None
        os.rename(request, taken)
    except OSError:
        return None
    note = None
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError, RecursionError):
        raw = read_regular(taken, 64 << 10, follow=False)  # non-blocking, capped, never a link
        note = json.loads(raw or b"{}").get("note")
        note = note if isinstance(note, str) else None
    res = write_snapshot_bundle(ctx, note)
    done = _answer_path(request, ".done.json")
    with contextlib.suppress(OSError):
        tmp = done.with_name("." + done.name + ".tmp")
        tmp.write_text(json.dumps({"path": str(res.path) if res.path else None, "complete": res.complete,
                                   "errors": res.errors, "cause": res.cause}))
        os.replace(tmp, done)
    with contextlib.suppress(OSError):
        taken.unlink()
    return res


class BundleRequestWatcher:
    """A `Watcher` that answers `xpu-serve bundle` requests while an incarnation runs.

    Scans RUNTIME/requests/ when woken (`wake()`: the supervisor calls it on SIGUSR1, which
    `xpu-serve bundle` sends after dropping its request; no polling while idle), at the start of
    each incarnation, and every `interval_s` seconds (default 10 s) as a fallback for a request
    whose signal could not be sent. Each request is served in a thread (`serve_bundle_request`),
    so the event loop never blocks. It never calls `ctx.fail`: a snapshot is not a failure.
    """

    name = "bundle-requests"

    def __init__(self, interval_s: float = SLOW_SCAN_S):
        self.interval_s = interval_s
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def wake(self) -> None:
        """Scan the request folder now (thread-safe; a no-op between incarnations)."""
        loop, ev = self._loop, self._wake
        if loop is None or ev is None:
            return
        with contextlib.suppress(RuntimeError):  # loop closed
            loop.call_soon_threadsafe(ev.set)

    async def run(self, ctx: IncarnationContext) -> None:
        req_dir = Path(ctx.runtime_dir) / REQUESTS_DIR
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while True:
            self._wake.clear()
            try:
                pending = sorted(req_dir.glob("bundle-*.json"))
            except OSError:
                pending = []
            for req in pending:
                if req.name.endswith(".done.json"):
                    continue
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(serve_bundle_request, ctx, req)
            await aio.wait_event(self._wake, self.interval_s)


def wake_supervisor(pid: int | None) -> bool | None:
    """Send SIGUSR1 to the supervisor `pid` (from its lock file or state.json) so it scans
    RUNTIME/requests/ at once.

    Returns True when sent; None when not sent because the process does not catch SIGUSR1 (an
    older supervisor that polls its request folder on its own: the default action would kill
    it); False when there is no usable pid or the signal cannot be sent (another user, gone,
    /proc unreadable): the supervisor then finds the request on its slow scan (`SLOW_SCAN_S`).
    """
    if pid is None or pid <= 0:
        return False
    caught = procfs.catches_signal(pid, signal.SIGUSR1)
    if caught is None:
        return False
    if not caught:
        return None
    try:
        os.kill(pid, signal.SIGUSR1)
    except OSError:
        return False
    return True


def wait_for_answer(request: Path, ack_timeout_s: float, timeout_s: float) -> dict[str, Any] | None:
    """Wait for a supervisor to take `request` (within `ack_timeout_s`) and answer it (within
    `timeout_s`). Returns the answer dict, or None (not taken: the request file is withdrawn;
    or no answer in time)."""
    done = _answer_path(request, ".done.json")
    taken = _answer_path(request, ".taken")
    t0 = time.monotonic()
    acked = False
    while True:
        if done.exists():
            try:
                ans: dict[str, Any] = json.loads(done.read_text())
            except (OSError, ValueError):
                time.sleep(0.05)
                continue
            with contextlib.suppress(OSError):
                done.unlink()
            return ans
        if not acked and (taken.exists() or not request.exists()):
            acked = True
        elapsed = time.monotonic() - t0
        if not acked and elapsed > ack_timeout_s:
            try:
                request.unlink()  # withdraw; if it is gone, a supervisor took it just now
            except FileNotFoundError:
                acked = True
                continue
            return None
        if elapsed > timeout_s:
            return None
        time.sleep(0.05)
