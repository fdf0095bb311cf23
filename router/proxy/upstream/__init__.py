"""A small HTTP/1.1 keep-alive client for the hot path to the upstream workers.

aiohttp's ClientSession costs too much CPU per request for a router whose whole job is to
forward. This client is a plain asyncio Protocol (the default loop and uvloop alike) that
sends a pre-encoded request (`request.encode_request`) and parses only what a proxy needs:
the status, the headers, and the body framing (Content-Length, chunked, or until close).

A body is either read (`read_some`, `read_all`) or piped: `pipe(sink)` hands every decoded
body byte to `sink.write` straight from `data_received`, one call per read from the socket,
so that a streamed answer costs no task wake-up per chunk.

Connections are kept per (host, port) in an `UpstreamPool`, most recently used first, and
closed after `keepalive_s` idle: shorter than the workers' own keep-alive (uvicorn: 5 s) so
that we, not they, close an idle connection. When they do close one first, the next request
on it fails with `ConnectionBroken(stale=True)`, and the caller resends it at once.

The modules, each importing only those before it:
- `errors`: what the client raises.
- `request`: a request as bytes.
- `response_head`: a response's status line and headers, parsed.
- `chunks`: chunk-size lines of a chunked body, read.
- `decoder`: where the parser is in an answer, and the general parser of its bytes.
- `sinks`: what a connection pipes its body to, and what it tells its pool.
- `buffer`: decoded body bytes held for a reader, its waiter, and the reading switch.
- `connection`: `UpstreamConnection`, one keep-alive connection (an asyncio Protocol).
- `pool`: `UpstreamPool`, the connections per worker, connecting and reusing them.
"""
