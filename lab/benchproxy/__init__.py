"""Benchmarks of the router's own cost.

- `bench-proxy`: fake OpenAI backends on loopback, then, one at a time, each router under
  test in front of them (globalpool, a plain aiohttp proxy, vllm-router, sglang-router,
  Envoy); one load generator drives the same workloads at each and reads the router's CPU
  time from /proc. `run.py` orchestrates; `report.py` writes JSON, a table and a chart.
  `--throughput` (`throughput.py`): requests/s under wrk through the compiled router
  with 1 and 2 router processes.
- `bench-decision`: one routing decision against snapshots of 10 to 10,000 workers.
- `bench-heartbeats`: the router's CPU to keep its snapshot fresh under heavy heartbeating.

Nothing here is imported by the router itself.
"""
