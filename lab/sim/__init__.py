"""A vLLM engine simulator for tests, demos and benchmarks on machines without GPUs.

It speaks vLLM 0.32's OpenAI API and /metrics, models continuous batching in real time
(batch slots, KV blocks, prefill rate, decode steps that slow with the batch, queueing,
prefix caching), and has fault knobs at /sim/faults. It says it is a simulator
(`/version` -> {"simulator": true}) and never stands in for vLLM in production.

    config.py    SimConfig: capacity and speed
    engine.py    the continuous-batching loop (sequence.py, kv.py, tokens.py, clock.py)
    api.py       aiohttp handlers and build_app (protocol.py, responses.py, errors.py)
    metrics.py   vLLM's metric names from engine events
    faults.py    fault knobs and their seeded draws
    server.py    SimServer: the app on a TCP port
    cli.py       flags and run_sim for the `globalpool` command
"""
