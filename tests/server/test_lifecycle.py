"""`agent-infer serve` as a process tree (supervisor, engine core, front ends), from outside:
the core is another process than the HTTP server, SIGTERM drains, a killed core turns
into 503s and a non-zero exit, two front ends share the port and the metrics, one front
end dying leaves the other serving, neither a 10 MB prompt nor a slow template stalls
/health, and the front ends started beside a loading core never outlive a start that
fails or a supervisor that is killed."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager

import httpx
import pytest

from agent_infer.core.watch import alive
from tests.server.conftest import parse_metrics, process_state

MODEL = "life-model"


@contextmanager
def serve(*flags: str, timeout: float = 180.0):
    """`python -m agent_infer.server.cli` on a free port; yields (process, base URL, stderr
    lines so far, read by a thread)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_PROXY="*")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_infer.server.cli", "--port", "0", "--device", "cpu", "--dtype", "float32",
         "--max-model-len", "512", "--kv-cache-gib", "0.05", "--served-model-name", MODEL, "--log-level", "info",
         *flags],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "the server did not come up:\n" + "".join(lines)
            found = [m for line in list(lines) if (m := re.search(r"serving \S+ on (http://[\d.]+:\d+)", line))]
            url = found[0].group(1) if found else None
            time.sleep(0.05)
        yield proc, url, lines
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        reader.join(5)


def _children(pid: int) -> dict[str, list[int]]:
    """The supervisor's children by role: core, front ends."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        pids = [int(p) for p in f.read().split()]
    roles: dict[str, list[int]] = {"core": [], "front_end": []}
    for child in pids:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode()
        if "agent_infer.core" in cmdline:
            roles["core"].append(child)
        elif "agent_infer.server.frontend" in cmdline:
            roles["front_end"].append(child)
    return roles


@contextmanager
def _stopped(pid: int, timeout: float = 10.0):
    """The process stopped (SIGSTOP) for the block: it runs no code, so it accepts no
    connection; continued (SIGCONT) after it, whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout
        while process_state(pid) != "T":
            assert time.monotonic() < deadline, f"process {pid} did not stop"
            time.sleep(0.01)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _stream(client: httpx.Client, body: dict) -> tuple[list[dict], bool]:
    """Every JSON event of a streamed completion, and whether it ended with [DONE]."""
    events, done = [], False
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events, done


def _body(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)), daemon=True)
    thread.start()
    return thread, result


def _wait_generating(url: str, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = parse_metrics(httpx.get(url + "/metrics", trust_env=False, timeout=10).text)
        if m.get("agent_infer_num_requests_running", 0) >= count and m.get("agent_infer_generation_tokens_total", 0):
            return
        time.sleep(0.05)
    raise AssertionError(f"{count} requests did not start")


def test_the_core_is_its_own_process_and_sigterm_drains(default_model_dir):
    with serve("--shutdown-timeout", "4") as (proc, url, lines):
        roles = _children(proc.pid)
        assert len(roles["core"]) == 1 and len(roles["front_end"]) == 1
        assert roles["core"][0] != roles["front_end"][0] != proc.pid
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as c:
            short, short_result = _in_thread(_stream, c, _body("Count to ten:", 12))
            long_, long_result = _in_thread(_stream, c, _body("Tell me a long story:", 450))
            whole, whole_result = _in_thread(lambda: c.post("/v1/completions", json=_body("Once upon", 450)))
            _wait_generating(url, 3)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            refused = c.post("/v1/completions", json=_body("too late", 2))
            health = c.get("/health")
            for t in (short, long_, whole):
                t.join(30)
        code = proc.wait(30)
        elapsed = time.monotonic() - t0
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert health.status_code == 503
    events, done = short_result[0]
    assert done and "error" not in events[-1], (events[-3:], "".join(lines))
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # finished within the drain
    events, done = long_result[0]
    assert done, "a stream ended without [DONE]"
    assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "abort"
    assert events[-1]["error"]["code"] == "server_shutting_down"
    assert whole_result[0].status_code == 503 and whole_result[0].json()["error"]["code"] == "server_shutting_down"
    assert code == 0 and elapsed < 4 + 15
    log = "".join(lines)
    assert "Traceback" not in log and "CancelledError" not in log
    for phase in ("admitting no new requests", "aborted", "stopping the engine core", "engine core stopped"):
        assert phase in log, (phase, log)


def test_a_killed_core_gives_503s_and_the_server_exits(default_model_dir):
    with serve() as (proc, url, lines):
        core = _children(proc.pid)["core"][0]
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as c:
            streaming, stream_result = _in_thread(_stream, c, _body("Tell me a long story:", 450))
            whole, whole_result = _in_thread(lambda: c.post("/v1/completions", json=_body("Once upon", 450)))
            _wait_generating(url, 2)
            os.kill(core, signal.SIGKILL)
            t0 = time.monotonic()
            streaming.join(10)
            whole.join(10)
            answered = time.monotonic() - t0
            try:
                new = c.post("/v1/completions", json=_body("anyone?", 2)).status_code
            except httpx.TransportError:
                new = "closed"  # the front end had already left
        code = proc.wait(15)
    events, done = stream_result[0]
    assert done and events[-1]["error"]["code"] == "engine_unavailable"
    assert whole_result[0].status_code == 503 and whole_result[0].json()["error"]["code"] == "engine_unavailable"
    assert answered < 5 and new in (503, "closed")
    assert code != 0
    assert "Traceback" not in "".join(lines)


def test_two_front_ends_share_the_port_and_the_metrics_and_stall_on_nothing(default_model_dir):
    """Two front ends on one port: /health stays fast while a 10 MB prompt and a slow
    request template are in flight, each front end serves every new connection while the
    other is stopped, /metrics gives the same totals from either, one front end killed
    leaves the other serving, and Ctrl-C (SIGINT) stops the rest."""
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    flags = ("--api-server-count", "2", "--trust-request-chat-template", "--chat-template-timeout", "3")
    with serve(*flags) as (proc, url, lines):
        front_ends = _children(proc.pid)["front_end"]
        assert len(front_ends) == 2
        # Encoded here, before timing: a thread of this process encoding 10 MB of JSON
        # would hold its GIL and delay the probes below, which measure the server alone.
        huge = json.dumps({"model": MODEL, "prompt": "lorem ipsum " * (10 * 2**20 // 12), "max_tokens": 1}).encode()
        template = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                    "chat_template": slow}
        t_huge, huge_result = _in_thread(lambda: httpx.post(
            url + "/v1/completions", content=huge, headers={"content-type": "application/json"}, trust_env=False,
            timeout=60))
        t_tmpl, tmpl_result = _in_thread(lambda: httpx.post(url + "/v1/chat/completions", json=template,
                                                            trust_env=False, timeout=60))
        times = []
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as c:
            c.get("/health")  # the connection is open before timing starts
            for _ in range(50):
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                times.append(time.perf_counter() - t0)
                time.sleep(0.03)
        t_huge.join(60)
        t_tmpl.join(60)
        serving = _children(proc.pid)["front_end"]  # for the message below, if one has gone
        for _ in range(24):  # a fresh connection each, taken by whichever front end accepts first
            r = httpx.post(url + "/v1/completions", json=_body("Hi", 2), trust_env=False, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        # The front ends share one accept queue (no kernel hash over sockets of their own):
        # whichever runs first takes a connection, so how the 24 spread is up to the
        # scheduler (a loaded machine once gave all 24 to one). Each in turn is made the only
        # one that can accept, the other stopped: it must serve every new connection.
        index = {int(m.group(2)): m.group(1) for line in list(lines)
                 if (m := re.search(r"front end (\d+) ready \(pid (\d+)\)", line))}
        for held, other in ((front_ends[1], front_ends[0]), (front_ends[0], front_ends[1])):
            free = f"agent_infer_front_end_requests_total{{front_end={index[other]}}}"
            with _stopped(held):
                before = parse_metrics(httpx.get(url + "/metrics", trust_env=False, timeout=10).text).get(free, 0)
                for _ in range(4):
                    r = httpx.post(url + "/v1/completions", json=_body("Hi", 2), trust_env=False, timeout=60)
                    assert r.status_code == 200
                after = parse_metrics(httpx.get(url + "/metrics", trust_env=False, timeout=10).text)[free]
            assert after - before == 4, (free, before, after)
        models = httpx.get(url + "/v1/models", trust_env=False).json()["data"]
        scrapes = [parse_metrics(httpx.get(url + "/metrics", trust_env=False, timeout=10).text) for _ in range(8)]
        os.kill(front_ends[0], signal.SIGKILL)
        time.sleep(0.5)
        for _ in range(6):
            r = httpx.post(url + "/v1/completions", json=_body("Still there?", 2), trust_env=False, timeout=60)
            assert r.status_code == 200
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
    # Inclusive: numpy's linear rule. The default (exclusive) rule extrapolates past the
    # slowest of 50 probes, so one 79 ms probe read as a 114 ms p99.
    p99 = statistics.quantiles(times, n=100, method="inclusive")[98]
    assert p99 < 0.100, sorted(times)[-5:]
    assert huge_result[0].status_code == 400 and huge_result[0].json()["error"]["code"] == "context_length_exceeded"
    assert tmpl_result[0].status_code == 400 and tmpl_result[0].json()["error"]["code"] == "template_timeout"
    assert models[0]["id"] == MODEL and models[0]["max_model_len"] == 512
    per_front_end = {k: v for k, v in scrapes[0].items() if k.startswith("agent_infer_front_end_requests_total")}
    assert len(per_front_end) == 2 and all(v > 0 for v in per_front_end.values()), (
        per_front_end, f"front ends {front_ends}, {serving} before the 24 requests", "".join(lines[-30:]))
    assert sum(per_front_end.values()) == 24 + 8  # the two refused above never reached the core
    for key in ("agent_infer_requests_received_total", "agent_infer_generation_tokens_total"):
        assert {s[key] for s in scrapes} == {scrapes[0][key]}  # the same totals whoever answered
    assert code == 1  # it shut down cleanly, but a front end had failed
    log = "".join(lines)
    assert "exited with code" in log and "Traceback" not in log


@pytest.mark.parametrize("flags", [("--api-server-count", "0"), ("--max-num-seqs", "0"), ("--shutdown-timeout", "-1")])
def test_bad_serve_flags_are_one_line_errors(flags):
    r = subprocess.run([sys.executable, "-m", "agent_infer.server.cli", *flags], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode in (1, 2), r.stderr
    assert r.stderr.count("\n") == 1 and "agent-infer: error:" in r.stderr and "Traceback" not in r.stderr


def _tagged(tag: str) -> dict[int, str]:
    """Live processes whose environment holds AGENT_INFER_TEST_TAG=tag: pid -> command line."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"AGENT_INFER_TEST_TAG={tag}".encode() not in f.read().split(b"\0"):
                    continue
            if not alive(int(entry)):
                continue  # exited, not yet reaped
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def _none_left(tag: str, timeout: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _serve_tagged(tag: str, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", AGENT_INFER_TEST_TAG=tag)
    return subprocess.Popen(
        [sys.executable, "-m", "agent_infer.server.cli", "--port", "0", "--device", "cpu", "--dtype", "float32",
         "--kv-cache-gib", "0.05", "--api-server-count", "2", *flags],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)


def test_a_core_that_fails_to_start_leaves_no_front_end_behind(default_model_dir):
    """The front ends start beside the core; the core refuses the configuration (a
    context past the model's positions): one line, exit code 1, and no process left."""
    tag = uuid.uuid4().hex
    proc = _serve_tagged(tag, "--max-model-len", "100000")
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err
    assert err.count("\n") == 1 and "exceeds the model's max_position_embeddings" in err and "Traceback" not in err
    assert not _none_left(tag, 10)


def test_a_supervisor_killed_while_the_core_loads_leaves_nothing_behind(default_model_dir):
    """SIGKILL to the supervisor once its front ends are up and waiting for the core: the
    front ends (their spec never comes) and the core (its parent gone) all exit."""
    tag = uuid.uuid4().hex
    proc = _serve_tagged(tag, "--max-model-len", "512")
    try:
        deadline = time.monotonic() + 60
        while sum("agent_infer.server.frontend" in c for c in _tagged(tag).values()) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.02)
        assert proc.poll() is None  # the core is still loading: the server is not up
        proc.kill()
        proc.wait(10)
        left = _none_left(tag, 30)
    finally:
        for pid in _tagged(tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert not left, left
    err = proc.stderr.read()
    assert "serving" not in err and "Traceback" not in err, err  # killed before it was up; nothing crashed
