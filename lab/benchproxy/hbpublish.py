"""A pipelined heartbeat publisher for the heartbeat-plane benchmark (one process).

Publishes for workers [first, last) at `hz` each what worker/publisher.py writes for one
heartbeat: `SET <key> <json> PX <ttl>`, `HSET <region's loads> <worker> <load record>`,
on a worker's first heartbeat `PUBLISH <channel> <json>` (its announcement; nothing else
changes in this bench), and `PUBLISH <tap> <json>` once every TAP_RECHECK_S, as an agent
does while nobody watches the tap (`--tap-watched`: every heartbeat, as while someone
does). With `--legacy`, what agents wrote
before load records: `SET` and `PUBLISH <channel>` for every heartbeat. Real `Heartbeat`
JSON and load records (built by the schema once per worker; only `seq` and `sent_at_s`
change per beat, spliced into the encoded bytes). Unlike the worker's publisher it
pipelines many workers' commands in one write without MULTI, since one process stands in
for thousands of workers. With `--sign`, every heartbeat and record is signed as
worker.signing signs them: the router then verifies what it takes.

Every 10 ms it sends the beats due by then, unless more than `max_outstanding` replies
are still owed (Redis or this process cannot keep up): then beats are skipped and the
achieved rate, printed as JSON at the end, shows it.

    python -m lab.benchproxy.hbpublish --redis-url redis://127.0.0.1:6379/0 \\
        --prefix gp --first 0 --last 5000 --hz 4 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time
from urllib.parse import urlparse

from lab.benchproxy.decision import fleet
from lab.devstack.valkey import resp_command as command
from router.event_loop import new_event_loop
from worker.heartbeat_keys import HeartbeatKeys
from worker.load_records import load_record
from worker.publisher import TAP_RECHECK_S
from worker.schema import Heartbeat, LifecycleState
from worker.signing import SIGNATURE_FIELD, HeartbeatSigner, hmac_sha256_hex

TICK_S = 0.01


def worker_heartbeat(index: int, regions: int, ttl_s: float) -> Heartbeat:
    """A realistic heartbeat (varied load and performance) for worker `index`."""
    view = fleet(1, random.Random(index), 0.0)[0]
    return view.heartbeat.model_copy(update={
        "worker_id": f"hb-{index:05d}", "region": f"region-{index % regions}",
        "endpoint": f"http://127.0.{index // 256 % 256}.{index % 256}:8000",
        "seq": 0, "sent_at_s": 0.0, "ttl_s": ttl_s, "state": LifecycleState.READY,
    })


def _serving(heartbeat: Heartbeat, models: tuple[str, ...]) -> Heartbeat:
    """`heartbeat` serving `models` instead, when given."""
    return heartbeat.model_copy(update={"models": models}) if models else heartbeat


class Template:
    """One worker's heartbeat JSON, split around its `seq` and `sent_at_s` (side by side
    in both forms: `"seq":0,"sent_at_s":0.0` as pydantic writes it, `"sent_at_s":0.0,
    "seq":0` in the sorted canonical form a signer publishes). A signed beat is the
    canonical bytes with the two values spliced in, an HMAC over them and the signature
    appended: the bytes `HeartbeatSigner.signed_payload` writes, without re-serializing."""

    MARK = b'"seq":0,"sent_at_s":0.0'
    CANONICAL_MARK = b'"sent_at_s":0.0,"seq":0'

    def __init__(self, heartbeat: Heartbeat, keys: HeartbeatKeys,
                 signer: HeartbeatSigner | None) -> None:
        self.heartbeat = heartbeat
        self.key = keys.worker(heartbeat.worker_id).encode()
        self.loads = keys.loads(heartbeat.region).encode()
        self.field = heartbeat.worker_id.encode()
        self.signer = signer
        start = heartbeat.model_copy(update={"seq": 0, "sent_at_s": 0.0})
        if signer is None:
            encoded, mark = heartbeat.to_json().encode(), self.MARK
        else:
            start, signed = signer.signed_payload(start)
            encoded = signed[: signed.rindex(SIGNATURE_FIELD)] + b"}"  # the canonical bytes
            mark = self.CANONICAL_MARK
        self.before, found, self.after = encoded.partition(mark)
        if not found:
            raise ValueError("heartbeat JSON does not have seq and sent_at_s side by side")
        # The load record, split the same way: [1,"<worker>",<seq>,<sent_at_s>,...]
        record = load_record(start)
        self.record_head = b'[1,' + json.dumps(heartbeat.worker_id).encode() + b','
        if not record.startswith(self.record_head + b"0,0.0,"):
            raise ValueError("load record does not start with version, worker, seq, sent_at_s")
        self.record_tail = record[len(self.record_head) + len(b"0,0.0"):]
        # The tail split around `running` (after the digest), for busy workers.
        _, digest, _, self.after_running = self.record_tail.split(b",", 3)
        self.before_running = b"," + digest + b","
        self.slots = heartbeat.capacity.max_num_seqs

    def record(self, seq: int, now_s: float, busy: bool = False) -> bytes:
        """The load record of beat `seq` sent at `now_s`; `busy`: with a `running` count
        that changes at every beat (an idle fleet's load stays as it was)."""
        tail = (self.record_tail if not busy else b'%s%d,%s' % (
            self.before_running, (seq * 7 + len(self.field)) % (self.slots + 1),
            self.after_running))
        record = b'%s%d,%r%s' % (self.record_head, seq, now_s, tail)
        return record if self.signer is None else self.signer.signed_record(record)

    def payload(self, seq: int, now_s: float) -> bytes:
        if self.signer is None:
            return b'%s"seq":%d,"sent_at_s":%r%s' % (self.before, seq, now_s, self.after)
        canonical = b'%s"sent_at_s":%r,"seq":%d%s' % (self.before, now_s, seq, self.after)
        signature = hmac_sha256_hex(self.signer.secret, canonical)
        return canonical[:-1] + SIGNATURE_FIELD + signature.encode() + b'"}'


class Replies(asyncio.Protocol):
    """Counts RESP replies (each of ours is one line: +OK or :N)."""

    def __init__(self) -> None:
        self.received = 0
        self.errors = 0

    def data_received(self, data: bytes) -> None:
        self.received += data.count(b"\r\n")
        self.errors += data.count(b"-ERR")


async def publish(args: argparse.Namespace) -> dict[str, float]:
    url = urlparse(args.redis_url)
    keys = HeartbeatKeys(args.prefix)
    signer = None
    if args.sign:
        key_id, _, secret = args.sign.partition(":")
        signer = HeartbeatSigner(key_id=key_id, secret=secret.encode())
    models = tuple(m for m in args.models.split(",") if m)
    templates = [Template(_serving(worker_heartbeat(i, args.regions, args.ttl_s), models),
                          keys, signer) for i in range(args.first, args.last)]
    loop = asyncio.get_running_loop()
    transport, replies = await loop.create_connection(Replies, url.hostname, url.port or 6379)
    channel, tap = keys.channel.encode(), keys.tap.encode()
    ttl_ms = str(round(args.ttl_s * 1000)).encode()
    tap_every = max(1, round(TAP_RECHECK_S * args.hz))  # beats between two tries of the tap
    commands = 0  # sent, each answered by one reply line
    rate = len(templates) * args.hz
    started = time.monotonic()
    deadline = started + args.seconds
    sent = skipped = 0
    cursor = 0
    seq = 0
    stopping = asyncio.Event()  # SIGTERM: stop early, still report
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    while (now := time.monotonic()) < deadline and not stopping.is_set():
        due = int((now - started) * rate) - sent - skipped
        if due > 0:
            if (commands - replies.received) > args.max_outstanding:
                skipped += due
            else:
                batch = []
                wall = time.time()
                for _ in range(due):
                    template = templates[cursor]
                    cursor += 1
                    if cursor == len(templates):
                        cursor = 0
                        seq += 1
                    payload = template.payload(seq, wall)
                    batch.append(command(b"SET", template.key, payload, b"PX", ttl_ms))
                    if args.legacy or seq == 0:  # legacy: always; else the announcement
                        batch.append(command(b"PUBLISH", channel, payload))
                    if not args.legacy:
                        batch.append(command(b"HSET", template.loads, template.field,
                                             template.record(seq, wall, args.busy)))
                        if args.tap_watched or seq % tap_every == 0:
                            batch.append(command(b"PUBLISH", tap, payload))
                transport.write(b"".join(batch))
                commands += len(batch)
                sent += due
        await asyncio.sleep(TICK_S)
    elapsed = time.monotonic() - started
    for _ in range(100):  # up to 5 s for the last replies
        if replies.received >= commands:
            break
        await asyncio.sleep(0.05)
    transport.close()
    return {"sent": sent, "skipped": skipped, "seconds": elapsed,
            "achieved_per_s": sent / elapsed, "target_per_s": rate,
            "replies": replies.received, "errors": replies.errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--last", type=int, required=True)
    parser.add_argument("--regions", type=int, default=10)
    parser.add_argument("--hz", type=float, default=4.0)
    parser.add_argument("--ttl-s", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--max-outstanding", type=int, default=20_000)
    parser.add_argument("--sign", default="", help="key_id:secret to sign with")
    parser.add_argument("--models", default="",
                        help="comma-separated models the workers serve (default: varied)")
    parser.add_argument("--legacy", action="store_true",
                        help="every heartbeat on the routers' channel, no load records")
    parser.add_argument("--busy", action="store_true",
                        help="each record with another `running` count (by default only "
                        "seq and sent_at_s change, as for an idle worker)")
    parser.add_argument("--tap-watched", action="store_true",
                        help="every heartbeat on the tap channel too, as agents send while "
                        "someone subscribes to it")
    args = parser.parse_args()
    loop = new_event_loop()
    try:
        result = loop.run_until_complete(publish(args))
    finally:
        loop.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
