"""Routing by context length: workers of one model with different `max_model_len`."""

from __future__ import annotations

import json

import pytest

from router.core.outcome import Attempt, Failure, RequestRecord
from router.core.parse import ParsedRequest, parse_body
from router.policy import NoRoute, RouteRequest
from router.proxy.failures import TooLong, UpstreamFailure, worker_refusal
from router.proxy.retries import Retries
from router.proxy.routing_hints import route_request
from router.registry.drained import NOTHING_DRAINED
from router.registry.snapshot import UNBOUNDED_CONTEXT, Snapshot
from router.registry.worker_view import WorkerView
from tests.unit.test_policy import make_policy, snapshot, view
from worker.probe import parse_models
from worker.schema import Capacity, Heartbeat


def sized(worker_id: str, region: str, context: int | None, **kwargs: object) -> WorkerView:
    """`view` with a context length in its heartbeat's capacity."""
    plain = view(worker_id, region, **kwargs)  # type: ignore[arg-type]
    heartbeat = plain.heartbeat.model_copy(update={"capacity": Capacity(
        max_num_seqs=plain.slots, max_model_len=context)})
    return WorkerView(heartbeat, plain.received_at_s)


def fleet() -> Snapshot:
    """A short context at home (us-east), a long one 80 ms away."""
    return snapshot(sized("us-1", "us-east", 4096), sized("us-2", "us-east", 4096),
                    sized("eu-1", "eu-west", 32768))


def route(need: int, above: int = 0, exclude: frozenset[str] = frozenset()) -> RouteRequest:
    return RouteRequest(model="m", origin_region="us-east", prompt_tokens=need,
                        context_tokens=need, context_above=above, exclude=exclude)


@pytest.mark.parametrize("policy", ["predicted_ttft", "least_load", "round_robin",
                                    "power_of_two", "random"])
def test_a_request_longer_than_the_local_context_goes_where_it_fits(policy: str) -> None:
    chooser = make_policy(policy)
    for _ in range(10):
        assert chooser.pick(fleet(), route(4097)).worker.worker_id == "eu-1"
    # It fits anywhere: each policy's own choice, home included.
    assert {chooser.pick(fleet(), route(4000)).worker.worker_id for _ in range(30)} & {
        "us-1", "us-2"}


def test_nearest_never_leaves_the_clients_region_even_for_a_long_request() -> None:
    with pytest.raises(NoRoute, match="never leaves it"):
        make_policy("nearest").pick(fleet(), route(4097))


def test_a_request_longer_than_every_context_goes_to_the_longest_to_be_judged() -> None:
    # The router's token count is an estimate: the engine counts and says.
    assert make_policy().pick(fleet(), route(100_000)).worker.worker_id == "eu-1"


def test_after_a_refusal_only_longer_contexts_are_tried() -> None:
    policy = make_policy()
    assert policy.pick(fleet(), route(10, above=4096)).worker.worker_id == "eu-1"
    with pytest.raises(NoRoute):
        policy.pick(fleet(), route(10, above=32768))


def test_a_worker_that_gives_no_context_is_taken_to_fit_anything() -> None:
    snap = snapshot(sized("us-1", "us-east", 4096), sized("eu-1", "eu-west", None))
    assert snap.contexts("m") == (4096, UNBOUNDED_CONTEXT)
    assert make_policy().pick(snap, route(5000)).worker.worker_id == "eu-1"
    assert make_policy().pick(snap, route(10, above=1_000_000)).worker.worker_id == "eu-1"
    unknown = snapshot(view("us-1"), view("eu-1", "eu-west"))
    assert unknown.contexts("m") == (UNBOUNDED_CONTEXT, UNBOUNDED_CONTEXT)
    assert make_policy().pick(unknown, route(10**9)).worker.region == "us-east"


def test_residency_drains_and_exclusions_still_hold_for_a_long_request() -> None:
    long_only_away = snapshot(sized("us-1", "us-east", 4096), sized("eu-1", "eu-west", 32768))
    confined = route(8000)._replace(allowed_regions=frozenset({"us-east"}))
    # Never outside the allowed regions: the short worker, whose engine then says.
    assert make_policy().pick(long_only_away, confined).worker.worker_id == "us-1"
    with pytest.raises(NoRoute):
        make_policy().pick(long_only_away, route(8000, above=4096, exclude=frozenset({"eu-1"})))


def test_the_need_is_the_prompt_and_the_output_of_one_choice() -> None:
    def need(completion: int | None, choices: int = 1) -> int:
        parsed = ParsedRequest(model="m", stream=False, prompt_tokens=1000,
                               completion_tokens=completion, choices=choices)
        record = RequestRecord(model="m", kind="chat", stream=False, origin_region="us-east",
                               received_s=0.0, request_id="r")
        return route_request(parsed, record, NOTHING_DRAINED, None,
                             (None, "interactive", None)).context_tokens
    assert need(None) == 1001  # the engine fills what is left: one token at least
    assert need(0) == 1000  # embeddings
    assert need(3000, choices=3) == 2000  # max_tokens 1000, n 3


def vllm_refusal(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError",
                                 "param": None, "code": 400}}).encode()


@pytest.mark.parametrize(("message", "context"), [
    # vLLM 0.32's wordings, and an earlier release's.
    ("This model's maximum context length is 2048 tokens. However, your prompt contains "
     "3000 input tokens, which exceeds this limit even without any output tokens.", 2048),
    ("This model's maximum context length is 2048 tokens. However, your prompt contains "
     "90000 characters (more than 81920 characters, which is the upper bound for 2048 input "
     "tokens).", 2048),
    ("The decoder prompt (length 2048) plus the number of requested output tokens (at least "
     "1) is longer than the maximum model length of 2048.", 2048),
    ("max_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output "
     "tokens.", 4096),
    ("The engine prompt length 9000 exceeds the max_model_len 8192. Please reduce prompt.",
     8192),
    ("This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
     "(4000 in the messages, 1000 in the completion).", 4096),
])
def test_the_engines_refusals_for_length_are_read_with_its_context(message: str,
                                                                   context: int) -> None:
    refused = worker_refusal(400, vllm_refusal(message))
    assert isinstance(refused, TooLong) and refused.context == context
    assert refused.kind is Failure.TOO_LONG and refused.status == 400
    assert json.loads(refused.answer)["error"]["message"] == message  # as the client gets it


@pytest.mark.parametrize(("status", "body"), [
    (400, vllm_refusal("temperature must be non-negative")),
    (404, vllm_refusal("This model's maximum context length is 2048 tokens.")),
    (400, b"<html>maximum context length is 99999999999999999999 tokens</html>"),
    (400, b""),
])
def test_other_answers_are_not_refusals_for_length(status: int, body: bytes) -> None:
    assert worker_refusal(status, body) is None


def test_a_refusal_for_length_is_a_free_retry_to_a_longer_context_or_the_answer() -> None:
    retries = Retries()
    attempt = Attempt(worker_id="us-1", region="us-east", predicted_ttft_ms=1.0,
                      reason="local", started_s=0.0)
    refusal = worker_refusal(400, vllm_refusal(
        "This model's maximum context length is 4096 tokens."))
    assert isinstance(refusal, TooLong)
    retries.failed(attempt, refusal, "req-1")
    assert retries.free and attempt.failure is Failure.TOO_LONG
    assert retries.next_route(route(10), route(10).drained, fleet()).context_above == 4096
    assert not retries.hopeless(fleet(), "m")  # eu-west's 32768 may take it
    longest = Attempt(worker_id="eu-1", region="eu-west", predicted_ttft_ms=1.0,
                      reason="retry", started_s=0.0)
    retries.failed(longest, TooLong(32768, b"{}", "detail"), "req-1")
    assert retries.hopeless(fleet(), "m")  # none longer: the engine's answer is the client's


def test_the_agent_reads_the_context_from_the_model_cards() -> None:
    def card(model_id: str, length: object, parent: str | None = None) -> dict[str, object]:
        return {"id": model_id, "object": "model", "parent": parent, "max_model_len": length}
    served = parse_models({"data": [card("tiny-llama", 2048), card("lora", 2048, "tiny-llama")]})
    assert served.max_model_len == 2048
    for garbage in (0, -1, 2**40, 2048.0, True, "2048", None):
        assert parse_models({"data": [card("tiny-llama", garbage)]}).max_model_len is None
    assert parse_models({"data": [{"id": "gpt-x"}]}).max_model_len is None


def test_a_heartbeat_without_a_context_leaves_the_field_out() -> None:
    plain = view("us-1").heartbeat
    assert "max_model_len" not in plain.to_json()  # older routers still read it
    sized_beat = sized("us-1", "us-east", 8192).heartbeat
    assert json.loads(sized_beat.to_json())["capacity"]["max_model_len"] == 8192
    assert Heartbeat.from_json(sized_beat.to_json()) == sized_beat


def test_a_prompt_of_token_ids_counts_a_token_each() -> None:
    def estimate(prompt: object) -> int:
        body = json.dumps({"model": "m", "prompt": prompt}).encode()
        return parse_body(body, "completions", 64).prompt_tokens
    assert estimate(list(range(3000))) == 3000  # was 1: sent to any context
    assert estimate([list(range(100)), list(range(50))]) == 150
    assert estimate("x" * 400) == 100


def test_a_404_for_a_model_the_worker_does_not_serve_is_another_workers_to_take() -> None:
    refused = worker_refusal(404, vllm_refusal("The model `sql-lora` does not exist."))
    assert refused is not None and not isinstance(refused, TooLong)
    assert refused.kind is Failure.NOT_SERVED and refused.status == 404
    retries = Retries()
    attempt = Attempt(worker_id="us-1", region="us-east", predicted_ttft_ms=1.0,
                      reason="local", started_s=0.0)
    retries.failed(attempt, refused, "req-1")
    assert retries.free and not retries.hopeless(fleet(), "m")
    # Any other 404 is the client's (an endpoint the engine does not serve).
    assert worker_refusal(404, b'{"detail": "Not Found"}') is None


TIMEOUT = UpstreamFailure("no first byte within 10 s", Failure.TIMEOUT, status=504)
TOO_LONG = TooLong(4096, b"{}", "too long for 4096")
TOO_LONG_FOR_ALL = TooLong(32768, b"{}", "too long for 32768")
NOT_SERVED = worker_refusal(404, vllm_refusal("The model `m` does not exist."))


@pytest.mark.parametrize(("failures", "told"), [
    # eu-1, the long context, timed out; us-1 refused it as too long: the timeout is told.
    ([("eu-1", TIMEOUT), ("us-1", TOO_LONG)], TIMEOUT),
    # The same for a worker that said it does not serve the model after one that did failed.
    ([("us-1", TIMEOUT), ("us-2", NOT_SERVED)], TIMEOUT),
    # Refusals alone are the engines' answer; so is "too long" for the longest context.
    ([("us-1", TOO_LONG)], TOO_LONG),
    ([("us-1", TIMEOUT), ("eu-1", TOO_LONG_FOR_ALL)], TOO_LONG_FOR_ALL),
    # The last failure, when it is not a refusal.
    ([("us-1", TOO_LONG), ("eu-1", TIMEOUT)], TIMEOUT),
])
def test_a_refusal_after_a_failure_of_a_worker_that_could_serve_it_is_not_the_answer(
        failures: list[tuple[str, UpstreamFailure | None]], told: UpstreamFailure) -> None:
    retries = Retries()
    for worker_id, failure in failures:
        assert failure is not None
        retries.failed(Attempt(worker_id=worker_id, region="x", predicted_ttft_ms=1.0,
                               reason="local", started_s=0.0), failure, "req-1")
    assert retries.told(fleet(), "m") is told


def test_a_refusal_naming_a_context_beyond_the_workers_own_counts_for_its_own() -> None:
    def refused(worker_id: str, named: int) -> Retries:
        retries = Retries()
        retries.failed(Attempt(worker_id=worker_id, region="x", predicted_ttft_ms=1.0,
                               reason="local", started_s=0.0),
                       TooLong(named, b"{}", f"too long for {named}"), "req-1")
        return retries
    # us-1's heartbeat says 4,096; its engine says "too long for 1,000,000,000": the
    # request is not hopeless, and the retry goes to a context longer than 4,096.
    lying = refused("us-1", 10**9)
    assert not lying.hopeless(fleet(), "m")
    assert lying.next_route(route(5000), NOTHING_DRAINED, fleet()).context_above == 4096
    # A worker whose heartbeat gives no context (or that is gone) is taken at its word.
    unbounded = snapshot(sized("us-1", "us-east", None), sized("eu-1", "eu-west", 32768))
    untold = refused("us-1", 40000)
    assert untold.next_route(route(5000), NOTHING_DRAINED, unbounded).context_above == 40000
    assert refused("gone", 40000).hopeless(fleet(), "m")
    # The truth, as before: the longest context refused it.
    assert refused("eu-1", 32768).hopeless(fleet(), "m")
