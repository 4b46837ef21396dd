"""The connector's safety without vLLM: the wire-format check (field by field, and a few hundred
malformed payloads), the scheduler side's screen, the API server's edge middleware (driven as ASGI),
capabilities, and the worker's liveness and memory rules (budget, ledger, idle expiry)."""

from __future__ import annotations

import asyncio
import copy
import gc
import json
import time

import psutil
import pytest
import torch

import kvcmas_bench.methods  # noqa: F401  (registers the methods)
from kvcmas_bench.serving.vllm import guard
from kvcmas_bench.serving.vllm.edge import KVCMASGuard
from kvcmas_bench.serving.vllm.flow import ModelFacts
from kvcmas_bench.serving.vllm.worker import WorkerRuntime, capture_params, report_params

from .kv_fuzz import PROMPT, malformed, valid

SECRET = "0123456789abcdef0123456789abcdef"


def _agent(**changes) -> dict:
    meta = copy.deepcopy(valid(SECRET)["agent"])
    for k, v in changes.items():
        if v is ...:
            meta.pop(k)
        else:
            meta[k] = v
    return {"kvcmas": meta}


def _reason(params, **kw) -> str:
    with pytest.raises(guard.Invalid) as exc:
        guard.check(params, **kw)
    return str(exc.value)


# ---- the schema ------------------------------------------------------------------------------------
def test_valid_payloads_of_every_op_pass_and_plain_requests_carry_none():
    for op, meta in valid(SECRET).items():
        got = guard.check({"kvcmas": meta}, prompt_len=len(PROMPT) if op == "agent" else None, max_tokens=3)
        assert got is meta
    assert guard.check(None) is None
    assert guard.check({"kvcmas_key": "k7"}, in_process=True) is None  # the in-process engine's key


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"v": 2}, "'v' must be 1"),
        ({"v": True}, "'v' must be 1"),
        ({"op": "drop_all"}, "'op' must be one of"),
        ({"session": "victim"}, "'session' must be the session's secret"),
        ({"session": "ABCDEF0123456789ABCDEF0123456789"}, "'session' must be the session's secret"),
        ({"session": 12345}, "'session' must be the session's secret"),
        ({"method": "nosuch"}, "unknown method 'nosuch'"),
        ({"method": ["kvcmas"]}, "'method' must be a non-empty printable string"),
        ({"options": {"tau": 1.0}}, "method 'fullshared' has no option 'tau'"),
        ({"options": []}, "'options' must be an object"),
        (
            {"method": "kvcmas", "options": {"anchors": 10**6}},
            "option 'anchors' of method 'kvcmas' must be at most 65536",
        ),
        ({"trajectory": ""}, "'trajectory' must be a non-empty printable string"),
        ({"trajectory": "t" * 201}, "'trajectory' must be a non-empty printable string"),
        ({"trajectory": "a\u0000b"}, "'trajectory' must be a non-empty printable string"),
        ({"index": -1}, "'index' must be an integer in [0, 4095]"),
        ({"index": 1.0}, "'index' must be an integer"),
        ({"index": 2**70}, "'index' must be an integer"),
        ({"agent": None}, "'agent' must be a non-empty printable string"),
        ({"node": 5}, "'node' must be a non-empty printable string"),
        ({"ancestors": [1]}, "'ancestors' must be distinct indices of earlier agents"),
        ({"ancestors": [0, 0]}, "'ancestors' must be distinct indices of earlier agents"),
        ({"ancestors": ["0"]}, "'ancestors' must be a list of agent indices"),
        ({"segments": []}, "'segments' must be a list of 1 to 4096 segments"),
        ({"segments": {"kind": "PF"}}, "'segments' must be a list"),
        ({"segments": [{"kind": "PF", "n": 8, "x": 1}]}, "segment 0 must be an object with 'kind', 'n'"),
        ({"segments": [{"kind": "PX", "n": 8}]}, "segment 0: 'kind' must be PF or PH"),
        ({"segments": [{"kind": "PF", "n": 0}, {"kind": "PF", "n": 8}]}, "'n' must be an integer in [1, 16777216]"),
        ({"segments": [{"kind": "PH", "n": 8}]}, "segment 0: a PH segment needs a 'slot'"),
        ({"segments": [{"kind": "PH", "n": 8, "slot": "q", "schedule": "always"}]}, "'schedule' must be dense"),
        ({"segments": [{"kind": "PF", "n": 7}]}, "the segments cover 7 tokens, the prompt has 8"),
        ({"max_new_tokens": 4}, "'max_new_tokens' (4) exceeds the request's max_tokens (3)"),
        ({"max_new_tokens": "2"}, "'max_new_tokens' must be an integer"),
        ({"last": "no"}, "'last' must be true or false"),
        ({"capture_output": 1}, "'capture_output' must be true or false"),
        ({"key": ...}, "missing field 'key' for op 'agent'"),
        ({"segments": ...}, "missing field 'segments' for op 'agent'"),
        ({"what": "system"}, "unknown field 'what' for op 'agent'"),
        ({"salt": ["x"]}, "'salt' must be a non-empty printable string"),
    ],
)
def test_every_field_of_an_agent_request_is_checked(changes, words):
    assert words in _reason(_agent(**changes), prompt_len=len(PROMPT), max_tokens=3)


def test_the_shape_around_the_metadata_is_checked():
    assert "must be an object" in _reason([1])
    assert "'kvcmas' must be an object" in _reason({"kvcmas": [1]})
    assert "unknown kv_transfer_params key 'do_remote_prefill'" in _reason({"kvcmas": {}, "do_remote_prefill": 1})
    assert "in-process engine's" in _reason({"kvcmas_key": []})  # the request that killed the server
    assert "'kvcmas_key' must be a string" in _reason({"kvcmas_key": []}, in_process=True)
    cap = valid(SECRET)["capture"]
    assert "'what' must be system or reference" in _reason({"kvcmas": {**cap, "what": "weights"}})
    assert "missing field 'what'" in _reason({"kvcmas": {k: v for k, v in cap.items() if k != "what"}})
    assert "'end' must be true or false" in _reason({"kvcmas": {**valid(SECRET)["report"], "end": "yes"}})


def test_a_few_hundred_malformed_payloads_are_each_refused_with_one_line():
    payloads = malformed(SECRET, 400)
    reasons = set()
    for p in payloads:
        reason = _reason(p, prompt_len=len(PROMPT), max_tokens=3)  # Invalid, never anything else
        assert "\n" not in reason and len(reason) < 300
        reasons.add(reason.split(":")[0])
    assert len(payloads) == 400 and len(reasons) >= 15  # they break many different rules


# ---- capabilities --------------------------------------------------------------------------------
def test_a_session_secret_has_128_random_bits_and_its_public_tag_does_not_reveal_it():
    a, b = guard.new_secret(), guard.new_secret()
    assert len(a) == 32 and int(a, 16) >= 0 and a != b
    tag = guard.session_tag(a)
    assert a not in tag and tag == guard.session_tag(a) and tag != guard.session_tag(b)
    assert "'session' must be the session's secret" in _reason({"kvcmas": {**valid(SECRET)["report"], "session": tag}})
    # salts: per session and label, never equal across sessions
    assert guard.salt_for(a, "1.0") != guard.salt_for(b, "1.0") != guard.salt_for(b, "2.0")


class _Req:
    def __init__(self, params, salt=None, prompt=PROMPT, max_tokens=3):
        self.kv_transfer_params, self.cache_salt = params, salt
        self.num_prompt_tokens, self.max_tokens = len(prompt), max_tokens


def test_the_scheduler_side_screen_refuses_bad_metadata_and_foreign_salts_without_raising():
    params = _agent()
    salt = guard.expected_salt(params["kvcmas"])
    assert guard.screen_request(_Req(params, salt)) == (params["kvcmas"], None)
    meta, why = guard.screen_request(_Req(params, None))  # no salt: injected blocks would be shareable
    assert meta is None and "cache_salt is not its session's" in why
    meta, why = guard.screen_request(_Req(params, guard.salt_for(guard.new_secret())))
    assert meta is None and "cache_salt" in why
    assert guard.screen_request(_Req({"kvcmas_key": []}))[1].startswith("invalid kv_transfer_params")
    assert guard.screen_request(_Req(None)) == (None, None)

    class _Broken:  # a request whose attributes raise: still no exception
        @property
        def kv_transfer_params(self):
            raise RuntimeError("boom")

    assert guard.screen_request(_Broken()) == (None, "invalid kv_transfer_params (RuntimeError)")


# ---- the edge middleware ---------------------------------------------------------------------------
def _asgi(body: bytes, chunks: int = 1):
    """Drive :class:`KVCMASGuard` once: what the inner app saw, and what the client got."""
    seen, sent = {}, []

    async def app(scope, receive, send):
        msg = await receive()
        seen["body"], seen["headers"] = msg["body"], dict(scope["headers"])
        seen["next"] = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})

    parts = [body[i::chunks] for i in range(1)] if chunks == 1 else [body[: len(body) // 2], body[len(body) // 2 :]]
    queue = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    queue.append({"type": "http.disconnect"})

    async def receive():
        return queue.pop(0)

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"1")]}
    asyncio.run(KVCMASGuard(app)(scope, receive, send))
    return seen, sent


def test_the_edge_answers_bad_metadata_with_400_and_one_line_before_vllm_sees_it():
    seen, sent = _asgi(
        json.dumps({"prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": {"kvcmas_key": []}}).encode()
    )
    assert not seen and sent[0]["status"] == 400
    err = json.loads(sent[1]["body"])["error"]
    assert (
        err["code"] == 400 and err["message"].startswith("invalid kv_transfer_params: ") and "\n" not in err["message"]
    )


def test_the_edge_salts_every_kvcmas_request_in_its_sessions_namespace_whatever_the_client_sent():
    params = _agent()
    body = {"prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": params, "cache_salt": "shared-by-all"}
    seen, sent = _asgi(json.dumps(body).encode(), chunks=2)
    got = json.loads(seen["body"])
    assert got["cache_salt"] == guard.salt_for(SECRET, "") and got["kv_transfer_params"] == params
    assert seen["headers"][b"content-length"] == str(len(seen["body"])).encode()
    assert seen["next"] == {"type": "http.disconnect"}  # a streaming response still hears the client leave
    plain = json.dumps({"prompt": PROMPT, "max_tokens": 3}).encode()
    assert _asgi(plain)[0]["body"] == plain  # plain requests pass unchanged
    assert _asgi(b"{not json")[0]["body"] == b"{not json"  # vLLM answers what it cannot parse


# ---- the worker: a source only under its own tokens, liveness, memory ---------------------------------
def test_a_source_is_reused_only_under_identical_tokens():
    from kvcmas_bench.segments import Request, Segment, SegmentKV
    from kvcmas_bench.serving.vllm.worker import same_tokens

    src = SegmentKV(k=torch.zeros(1, 1, 3, 2), v=torch.zeros(1, 1, 3, 2), start=0, ids=(5, 6, 7))
    ok = Request("B", [Segment("PF", [1]), Segment("PH", [5, 6, 7], slot="q")], 1)
    same_tokens(ok, {"q": src})
    forged = Request("B", [Segment("PF", [1]), Segment("PH", [0, 0, 0], slot="q")], 1)
    with pytest.raises(ValueError, match="tokens differ from its source's"):
        same_tokens(forged, {"q": src})


def _rt(**kw) -> WorkerRuntime:
    return WorkerRuntime(ModelFacts(torch.ones(4), 2, 1, 8, torch.float32, "cpu", keep_ready=True), set(), **kw)


def _capture(rt, rid, session, what, ids) -> bool:
    """A prefill-only capture request served (as the connector drives it); False when the worker
    refused to buffer it (over its budget)."""
    rt.new_request(rid, capture_params(session, what)["kvcmas"], list(ids))
    plan = rt.plan_of(rid)
    if plan is not None:
        cap = plan.captures[0]
        cap.k.normal_(), cap.v.normal_(), cap.filled.fill_(True)
        rt.captured(rid)
    rt.finished(rid, [1])
    rt.drain()
    return plan is not None


def test_a_report_whose_step_fails_is_answered_with_the_error():
    rt = _rt()
    rt.sessions["0" * 32] = object()  # a broken session: its report raises inside the worker
    rt.new_request("rep", report_params("0" * 32)["kvcmas"], [1])
    rt.drain()
    (answer,) = rt.take_answers()[1]["rep"]
    assert answer["error"].startswith("AttributeError")


def test_the_ledger_counts_in_flight_capture_buffers():
    rt = _rt()
    rt.new_request("c1", capture_params("a" * 32, "system")["kvcmas"], list(range(16)))
    assert rt.held_bytes() == 2 * (2 * 1 * 16 * 8 * 4)  # the capture buffers, before anything is kept
    rt.finished("c1", [1])  # abandoned before its K/V was complete: nothing stays
    assert rt.held_bytes() == 0


def test_captures_beyond_the_budget_are_refused_and_idle_sessions_expire():
    """Bytes by hand: one 8-token capture is 2 layers x 1 head x 8 tokens x 8 dims x 4 bytes, K and V
    = 1024 bytes; a budget of 3000 holds two, a third is never buffered. Then the sessions expire."""
    rt = _rt(budget_bytes=3000, idle_s=0.5)
    kept = []
    for i in range(6):  # six abandoned sessions, each with a system prompt and a reference
        kept.append(_capture(rt, f"s{i}", f"{i:032x}", "system", range(10 * i, 10 * i + 8)))
        kept.append(_capture(rt, f"r{i}", f"{i:032x}", "reference", range(100 + i, 108 + i)))
        assert rt.held_bytes() <= 3000
    assert kept == [True, True] + [False] * 10 and rt.held_bytes() == 2 * 1024
    time.sleep(0.6)
    rt.new_request("rep", report_params("f" * 32)["kvcmas"], [1])  # any method-thread job expires them
    rt.drain()
    assert rt.held_bytes() == 0 and not rt.system_kv and not rt.references and set(rt.touched) == {"f" * 32}


def _expiry_scenario() -> None:
    """Run in a fresh interpreter by the test below: two large captures of abandoned sessions, then
    their expiry; prints the RSS at start, after the captures and after expiry, and the ledger."""
    for _ in range(3):  # raise malloc's dynamic threshold as a busy process would (to its 32 MiB cap)
        torch.empty(33 * 2**20, dtype=torch.uint8).fill_(1)
    rt = _rt(idle_s=2.0)
    rt.facts = ModelFacts(torch.ones(32), 8, 8, 64, torch.float32, "cpu", keep_ready=True)  # 16 KiB of K a token
    gc.collect()
    rss = psutil.Process().memory_info
    start = rss().rss
    for i in range(2):
        _capture(rt, f"s{i}", f"{i:032x}", "reference", range(5000 * i, 5000 * i + 4096))  # K and V 64 MiB each
    grown, held = rss().rss - start, rt.held_bytes()
    time.sleep(2.1)
    rt.new_request("rep", report_params("f" * 32)["kvcmas"], [1])
    rt.drain()
    gc.collect()
    print(json.dumps({"grown": grown, "held": held, "held_after": rt.held_bytes(), "after": rss().rss - start}))


def test_expired_sessions_give_their_memory_back_to_the_process():
    """Large captures of abandoned sessions: the ledger equals the process's growth, and after
    expiry the process's RSS is back within allocator slack (16 MiB) of where it started. Each K or
    V buffer is 64 MiB, above glibc's largest dynamic mmap threshold (32 MiB), so it is mapped fresh
    and unmapped when freed (the worker's case: a long-lived process). Measured in a fresh
    interpreter: in the test process, memory other tests freed can be trimmed or reused meanwhile
    and move its RSS by tens of MiB (seen in CI: 33 MiB)."""
    import subprocess
    import sys
    from pathlib import Path

    code = "from tests.test_vllm_guard import _expiry_scenario; _expiry_scenario()"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["held"] == 2 * 2 * 4096 * 16 * 1024
    assert abs(got["grown"] - got["held"]) < 16 * 2**20  # the ledger is what the process grew by
    assert got["held_after"] == 0
    assert got["after"] < 16 * 2**20


def test_the_deployment_loads_the_edge_check_and_serves_bfloat16_on_cuda_by_default():
    import sys

    from kvcmas_bench.serving.vllm.http import ServerOptions, _dtype_arg, serve_command

    cmd = serve_command("m", 8000, _dtype_arg("auto", cpu=False), ServerOptions(vllm_bin=sys.executable), cpu=False)
    assert cmd[cmd.index("--middleware") + 1] == "kvcmas_bench.serving.vllm.edge.KVCMASGuard"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert _dtype_arg("auto", cpu=True) == "float32" and _dtype_arg("float16", cpu=False) == "float16"
    from kvcmas_bench.serving.vllm import edge

    mod, name = cmd[cmd.index("--middleware") + 1].rsplit(".", 1)
    assert mod == edge.__name__ and callable(getattr(edge, name))


def test_every_method_thread_job_waits_for_the_last_steps_capture_copies_first():
    """On CUDA the connector records an event after a step's capture copies (queued on the engine's
    stream); a job of the method thread synchronizes it before it reads anything."""
    rt = _rt()
    order = []

    class _Event:
        def synchronize(self):
            order.append("synchronized")

    rt.step_event = _Event()
    rt.submit(lambda: order.append("job"))
    rt.drain()
    assert order[:2] == ["synchronized", "job"]


@pytest.mark.parametrize(
    ("arg", "words"),
    [
        ({"session_idle_s": "-1"}, "session_idle_s must be a positive number, got -1.0"),
        ({"deadline_s": "inf"}, "deadline_s must be a positive number"),
        ({"budget_gib": "0"}, "budget_gib must be a positive number"),
    ],
)
def test_the_deployments_limits_must_be_positive(arg, words):
    from kvcmas_bench.errors import BenchError
    from kvcmas_bench.serving.vllm.http import ServerOptions, kv_transfer_config

    with pytest.raises(BenchError, match=words):
        ServerOptions.parse(arg)
    extra = kv_transfer_config(0.5, 30.0, 10.0)["kv_connector_extra_config"]
    assert extra == {"budget_gib": 0.5, "session_idle_s": 30.0, "deadline_s": 10.0}


# ---- the client: a broken stream is a failed request ----------------------------------------------------
def _serve_once(body: bytes, chunked_cut: bool = False):
    """A one-shot HTTP server answering any POST with ``body`` (an SSE stream); ``chunked_cut``:
    chunked encoding, the connection dropped inside a chunk. Returns its base URL."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def handle():
        conn, _ = srv.accept()
        conn.recv(65536)
        if chunked_cut:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            conn.sendall(f"{len(body) + 50:x}\r\n".encode() + body)  # promises 50 bytes more
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + body)
        conn.close()
        srv.close()

    threading.Thread(target=handle, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}"


CHUNK = b'data: {"choices": [{"token_ids": [5]}]}\n\n'


@pytest.mark.parametrize("chunked_cut", [False, True])
def test_a_stream_cut_short_is_a_failed_request_not_a_short_answer(chunked_cut):
    from kvcmas_bench.serving.vllm.http import HTTP, ServerLost

    url = _serve_once(CHUNK * 2, chunked_cut)
    with pytest.raises(ServerLost, match="without \\[DONE\\]|broke off a stream"):
        HTTP(url).stream({"prompt": [1]}, time.perf_counter)
    whole = HTTP(_serve_once(CHUNK * 2 + b"data: [DONE]\n\n")).stream({"prompt": [1]}, time.perf_counter)
    assert whole.tokens == [5, 5] and whole.done_s is not None


def test_method_state_is_in_the_ledger_and_idle_sessions_go_when_nothing_else_can():
    """A session's method state (anchor pools) counts; beyond the budget with no trajectory left to
    drop, the least recently used idle session goes (the one being served stays)."""
    from kvcmas_bench.serving.vllm.worker import Session

    class _State:
        def __init__(self, n):
            self.n = n

        def state_bytes(self):
            return self.n

    rt = _rt(budget_bytes=6000)
    old, new = "a" * 32, "b" * 32
    rt.sessions[old], rt.sessions[new] = Session(_State(5000), None), Session(_State(4000), None)
    rt.touched[old], rt.touched[new] = 1.0, 2.0
    assert rt.held_bytes() == 9000
    rt._evict(None, rt.sessions[new])
    assert list(rt.sessions) == [new] and rt.held_bytes() == 4000 and rt.sessions_evicted == 1
    rt.budget = 3000
    with pytest.raises(MemoryError, match="over its budget"):
        rt._evict(None, rt.sessions[new])  # only the session being served is left: refuse instead


def test_a_plan_the_scheduler_gave_up_on_is_never_applied(slow_method):
    """The scheduler side's deadline passed while the plan was being made: the plan is dropped when
    it arrives, the request's record is the error."""
    from kvcmas_bench.segments import Request, Segment
    from kvcmas_bench.serving.vllm.worker import ABANDONED, agent_params

    rt = _rt()
    req = Request("A", [Segment("PF", [1, 2, 3]), Segment("PH", [4, 5, 6, 7], slot="ctx")], 2, node="A")
    meta = agent_params(SECRET, slow_method.name, {}, "t0", 0, req, [], "key-1", last=True)["kvcmas"]
    rt.new_request("r1", meta, req.prompt_ids)
    rt.abandon("r1")
    slow_method.gate.set()
    rt.drain()
    claims, _, errors = rt.take_answers()
    assert rt.plan_of("r1") is None and claims == {"r1": 0} and errors == {"r1": ABANDONED}
