"""TextWorkers: chat templates rendered and long texts tokenized in worker processes that
can be killed, against the real default model's tokenizer.

One pool is shared by the module (starting a worker means importing transformers): the
tests that kill workers wait for the replacements before they return, and the last test
closes it."""

from __future__ import annotations

import asyncio
import copy
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from agent_infer.loader.tokenizer import ChatFormatter, load_tokenizer
from agent_infer.server.text_workers import TemplateError, TextLimits, TextWorkers

TIMEOUT_S = 1.5
OUTPUT_LIMIT = 200_000
NUM_WORKERS = 2
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Runs far longer than any time limit here: only a kill ends it.
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HELLO = [{"role": "user", "content": "What is the capital of France?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}
TOOLS = [{"type": "function", "function": WEATHER}]
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{{ greeting }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def pool(loop, default_model_dir):
    limits = TextLimits(template_timeout_s=TIMEOUT_S, max_template_output_chars=OUTPUT_LIMIT, encode_timeout_s=120.0)
    pool = TextWorkers(default_model_dir, num_workers=NUM_WORKERS, limits=limits)
    loop.run_until_complete(pool.start())
    yield pool
    loop.run_until_complete(pool.close())


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def render(pool: TextWorkers, messages: list[dict], *, add_generation_prompt: bool = True,
           continue_final_message: bool = False, tools: list[dict] | None = None, chat_template: str | None = None,
           template_kwargs: dict | None = None):
    return pool.render_chat(messages, add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message, tools=tools, chat_template=chat_template,
                            template_kwargs=template_kwargs or {})


def render_error(loop, pool: TextWorkers, messages: list[dict] = HELLO, **kwargs) -> TemplateError:
    with pytest.raises(TemplateError) as info:
        loop.run_until_complete(render(pool, messages, **kwargs))
    return info.value


async def wait_full(pool: TextWorkers, timeout: float = 120.0) -> None:
    """Until every worker (replacements included) is started and idle."""
    deadline = time.monotonic() + timeout
    while pool.num_idle < NUM_WORKERS or len(pool.pids) != NUM_WORKERS:
        assert time.monotonic() < deadline, f"the pool did not refill: {pool.num_idle} idle, pids {pool.pids}"
        await asyncio.sleep(0.05)


def exited(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet whose threads are all gone too (its leader
    turns zombie first, and the last thread to exit is the one that closes its files)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        return zombie and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except FileNotFoundError:
        return True


def peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


# --- the same prompt as ChatFormatter --------------------------------------------------

CONVERSATIONS = [
    pytest.param(dict(messages=HELLO), id="default-template"),
    pytest.param(dict(messages=[{"role": "system", "content": "Be brief."}, *HELLO,
                                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}],
                      add_generation_prompt=False), id="no-generation-prompt"),
    pytest.param(dict(messages=[*HELLO, {"role": "assistant", "content": "The capital of France is"}],
                      add_generation_prompt=False, continue_final_message=True), id="continue-final-message"),
    pytest.param(dict(messages=HELLO, tools=TOOLS, chat_template=TOOLS_TEMPLATE,
                      template_kwargs={"greeting": "Bonjour! "}), id="tools-and-kwargs"),
]


@pytest.mark.parametrize("case", CONVERSATIONS)
def test_render_chat_equals_chat_formatter_and_encode(loop, pool, tokenizer, case):
    text, ids = loop.run_until_complete(render(pool, **copy.deepcopy(case)))
    case = copy.deepcopy(case)
    expected = ChatFormatter(tokenizer, case.pop("chat_template", None)).render(
        case.pop("messages"), add_generation_prompt=case.pop("add_generation_prompt", True),
        continue_final_message=case.pop("continue_final_message", False), tools=case.pop("tools", None),
        **case.pop("template_kwargs", {}))
    assert text == expected
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    assert "France" in text


def test_tools_and_kwargs_reach_the_template(loop, pool):
    text, _ = loop.run_until_complete(render(pool, HELLO, tools=TOOLS, chat_template=TOOLS_TEMPLATE,
                                             template_kwargs={"greeting": "Bonjour! "}))
    assert '"name": "get_weather"' in text and "Bonjour! <|im_start|>user" in text


# --- the wall-clock limit ----------------------------------------------------------------

def test_slow_template_times_out_while_others_are_served_and_its_worker_is_replaced(loop, pool):
    loop.run_until_complete(wait_full(pool))
    before = set(pool.pids)

    async def scenario():
        start = time.monotonic()
        slow = asyncio.ensure_future(render(pool, HELLO, chat_template=NESTED_LOOPS))
        await asyncio.sleep(0.2)  # the slow render holds one worker
        t = time.monotonic()
        text, _ = await render(pool, HELLO)
        served_in = time.monotonic() - t
        with pytest.raises(TemplateError) as info:
            await slow
        failed_in = time.monotonic() - start
        after, _ = await render(pool, HELLO)  # right away, before the replacement is up
        return text, served_in, info.value, failed_in, after

    text, served_in, error, failed_in, after = loop.run_until_complete(scenario())
    assert served_in < 0.5, f"a normal render took {served_in:.2f} s beside the slow one"
    assert error.code == "template_timeout"
    assert str(error) == f"the chat template did not finish rendering within {TIMEOUT_S} s"
    assert TIMEOUT_S <= failed_in < TIMEOUT_S + 1.0
    assert after == text

    loop.run_until_complete(wait_full(pool))
    killed = before - set(pool.pids)
    assert len(killed) == 1 and all(exited(pid) for pid in killed)
    assert loop.run_until_complete(render(pool, HELLO))[0] == text


def test_cancelled_caller_does_not_strand_its_worker(loop, pool):
    loop.run_until_complete(wait_full(pool))
    before = set(pool.pids)
    busy = "{% for i in range(100000) %}{% for j in range(2) %}{% endfor %}{% endfor %}done"

    async def scenario():
        task = asyncio.ensure_future(render(pool, HELLO, chat_template=busy))
        await asyncio.sleep(0)  # the request is on its way to a worker
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        still_busy = pool.num_idle
        await wait_full(pool, timeout=TIMEOUT_S + 1.0)  # its worker finishes the render, then is idle again
        return still_busy

    assert loop.run_until_complete(scenario()) == NUM_WORKERS - 1
    assert set(pool.pids) == before


# --- errors ---------------------------------------------------------------------------------

def test_range_overflow_is_a_template_error(loop, pool):
    error = render_error(loop, pool, chat_template="{% for i in range(10**8) %}x{% endfor %}")
    assert not isinstance(error, OverflowError)
    assert error.code == "template_error"
    assert str(error).startswith("the chat template failed: OverflowError: Range too big.")


@pytest.mark.parametrize("template", [
    pytest.param("{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}", id="many-pieces"),
    pytest.param("{{ 'x' * 10**10 }}", id="one-huge-piece"),
    pytest.param("{% for i in range(1000) %}{{ messages * 1000 }}{% endfor %}", id="list-repetition"),
])
def test_output_bomb_is_stopped_while_it_renders(loop, pool, template):
    loop.run_until_complete(wait_full(pool))
    peaks = {pid: peak_rss_kib(pid) for pid in pool.pids}
    start = time.monotonic()
    error = render_error(loop, pool, chat_template=template)
    elapsed = time.monotonic() - start
    assert error.code == "template_output_too_large"
    assert str(error) == f"the chat template's output exceeds the limit of {OUTPUT_LIMIT:,} characters"
    assert elapsed < 3.0
    grown_mib = max(peak_rss_kib(pid) - peaks[pid] for pid in pool.pids) / 1024
    assert grown_mib < 64, f"a worker's peak memory grew by {grown_mib:.0f} MiB"


def test_output_under_the_limit_renders(loop, pool):
    text, _ = loop.run_until_complete(render(pool, HELLO, chat_template="{{ 'ab' * 90000 }}{{ 'c' * 10000 }}"))
    assert text == "ab" * 90000 + "c" * 10000


@pytest.mark.parametrize("template, kwargs, message", [
    pytest.param("{{ raise_exception('only user messages, please') }}", {},
                 "the chat template rejected the messages: only user messages, please", id="raise_exception"),
    pytest.param("{% for m in messages %}\n{{ m.content }", {},
                 "the chat template has a syntax error on line 2: unexpected '}'", id="syntax-error"),
    pytest.param("{{ messages[0].nope.deeper }}", {},
                 "the chat template rejected the messages: 'dict object' has no attribute 'nope'", id="undefined"),
    pytest.param("{{ ''.__class__.__mro__ }}{{ ().__class__.__base__.__subclasses__() }}", {},
                 "the chat template rejected the messages: access to attribute '__class__'", id="sandbox"),
    pytest.param("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", {},
                 "the chat template failed: RecursionError: maximum recursion depth exceeded", id="recursion"),
    pytest.param("{{ 1 + 'a' }}", {}, "the chat template failed: TypeError: unsupported operand", id="type-error"),
    pytest.param("{% for m in messages %}{{ m.role }}{% endfor %}",
                 {"messages": [*HELLO, {"role": "assistant", "content": "It is"}], "add_generation_prompt": False,
                  "continue_final_message": True},
                 'continue_final_message is set to "content" but this is not an accepted field', id="value-error"),
])
def test_template_errors_name_the_problem(loop, pool, template, kwargs, message):
    kwargs = {"messages": HELLO, **kwargs}
    error = render_error(loop, pool, chat_template=template, **kwargs)
    assert error.code == "template_error"
    assert str(error).startswith(message), str(error)


def test_workers_run_below_the_front_ends_priority(loop, pool):
    """Bulk text work yields the CPU to the event loop and the engine core."""
    from agent_infer.server.text_workers import WORKER_NICENESS

    loop.run_until_complete(wait_full(pool))
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert pool.pids and all(os.getpriority(os.PRIO_PROCESS, pid) == min(19, own + WORKER_NICENESS)
                             for pid in pool.pids)


# --- tokenizing -------------------------------------------------------------------------

def test_long_text_is_encoded_in_a_worker_and_short_inline(loop, pool, tokenizer, monkeypatch):
    inline_calls = []
    real_encode = pool.tokenizer.encode
    monkeypatch.setattr(pool.tokenizer, "encode", lambda *a, **k: inline_calls.append(1) or real_encode(*a, **k))
    long_text = " ".join(f"Paris {i} héllo 你好 ✓\n" for i in range(3000))
    assert len(long_text) > TextLimits().inline_encode_chars
    for special in (True, False):
        ids = loop.run_until_complete(pool.encode(long_text, special))
        assert ids == tokenizer.encode(long_text, add_special_tokens=special)
    assert inline_calls == []
    assert loop.run_until_complete(pool.encode("Paris", True)) == tokenizer.encode("Paris", add_special_tokens=True)
    assert inline_calls == [1]


def test_event_loop_keeps_running_while_a_huge_text_is_encoded(loop, pool, tokenizer):
    unit = "hello world\n"  # its ids repeat exactly, so the expected ids cost nothing to compute
    assert tokenizer.encode(unit * 3, add_special_tokens=False) == tokenizer.encode(unit, add_special_tokens=False) * 3
    copies = 5_000_000 // len(unit)

    async def scenario():
        gaps = []

        async def tick():
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.05)
        start = time.monotonic()
        ids = await pool.encode(unit * copies, False)
        elapsed = time.monotonic() - start
        ticker.cancel()
        return ids, elapsed, gaps

    ids, elapsed, gaps = loop.run_until_complete(scenario())
    assert ids == tokenizer.encode(unit, add_special_tokens=False) * copies
    assert len(gaps) > elapsed / 0.1  # the loop ticked all along
    assert max(gaps) < 0.1, f"the event loop stalled for {max(gaps) * 1000:.0f} ms during a {elapsed:.1f} s encode"


def test_module_does_not_import_torch():
    code = "import sys, agent_infer.server.text_workers; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stderr


# --- workers that die -----------------------------------------------------------------

def test_killed_workers_fail_their_request_are_replaced_and_calls_wait_for_them(loop, pool, caplog):
    loop.run_until_complete(wait_full(pool))
    before = set(pool.pids)

    async def scenario():
        slow = asyncio.ensure_future(render(pool, HELLO, chat_template=NESTED_LOOPS))
        await asyncio.sleep(0.3)  # one worker is busy with it, the other idle
        start = time.monotonic()
        for pid in before:
            os.kill(pid, signal.SIGKILL)
        # Blocks the loop on purpose, so that it has not yet seen the deaths: the next call
        # is sent to the dead idle worker first, and must be retried, not failed.
        while not all(exited(pid) for pid in before):
            time.sleep(0.01)
        normal = asyncio.ensure_future(render(pool, HELLO))
        with pytest.raises(TemplateError) as info:
            await slow
        failed_in = time.monotonic() - start
        text, _ = await normal  # no worker is left: it waits for a replacement, then is served
        return info.value, failed_in, text

    error, failed_in, text = loop.run_until_complete(scenario())
    assert error.code == "worker_died"
    assert str(error) == "the text worker stopped while rendering the chat template (it may have run out of memory)"
    assert failed_in < 1.0
    assert "France" in text
    assert "was found dead; its request goes to another" in caplog.text
    loop.run_until_complete(wait_full(pool))
    assert not before & set(pool.pids)


def test_no_chat_template_is_a_template_error_and_workers_exit_with_their_parent(default_model_dir, tmp_path):
    # The default model's tokenizer without its chat template.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_dir, name), tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    script = tmp_path / "parent.py"
    script.write_text(f"""
import asyncio, os, signal, sys
from agent_infer.server.text_workers import TemplateError, TextLimits, TextWorkers

def render(pool, template):
    return pool.render_chat([{{"role": "user", "content": "hi"}}], add_generation_prompt=True,
                            continue_final_message=False, tools=None, chat_template=template, template_kwargs={{}})

async def main():
    pool = TextWorkers(sys.argv[1], num_workers=1, limits=TextLimits(template_timeout_s=600.0))
    await pool.start()
    try:
        await render(pool, None)
    except TemplateError as e:
        print(e, flush=True)
    asyncio.ensure_future(render(pool, {NESTED_LOOPS!r}))
    await asyncio.sleep(0.3)  # the worker is busy: it reads no pipe, so only its watch thread can notice
    print(pool.pids[0], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    asyncio.run(main())
""")
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert out.returncode == -signal.SIGKILL, out.stderr
    message, worker = out.stdout.splitlines()
    assert message == "this model's tokenizer has no chat template; send a plain prompt instead"
    deadline = time.monotonic() + 5
    while not exited(int(worker)):
        assert time.monotonic() < deadline, "the worker outlived its parent"
        time.sleep(0.05)


def test_close_is_bounded_fails_pending_calls_and_leaves_no_process(loop, pool):
    """Last: it closes the shared pool (run alone, it closes a fresh one)."""
    loop.run_until_complete(wait_full(pool))
    pids = pool.pids

    async def scenario():
        slow = asyncio.ensure_future(render(pool, HELLO, chat_template=NESTED_LOOPS))
        await asyncio.sleep(0.2)
        start = time.monotonic()
        await pool.close()
        closed_in = time.monotonic() - start
        with pytest.raises(RuntimeError, match="closed"):
            await slow
        with pytest.raises(RuntimeError, match="closed"):
            await render(pool, HELLO)
        return closed_in

    closed_in = loop.run_until_complete(scenario())
    assert closed_in < 4.0
    assert len(pids) == NUM_WORKERS and all(exited(pid) for pid in pids)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]
    assert pool.pids == [] and pool.num_idle == 0
