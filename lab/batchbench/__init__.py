"""`globalpool bench-batch`: interactive latency and batch throughput on one local stack.

Issue 24's benchmark of the Batch API (router.batch). On the stack `globalpool up` starts
(lab.devstack.stack.LocalStack, regions priced differently), three phases:

1. `calibration`: a short batch on the otherwise idle fleet (lines/s when nothing else runs);
2. `baseline`: streaming chat from clients in every region, open loop, at a rate sized to
   hold a share of the fleet's slots; each request's client-side TTFT;
3. `with_batch`: the same interactive load while a batch of N lines, submitted with the
   `openai` client, runs; /metrics (batch lines by region), /admin/status (each worker's
   heartbeat load) and the batch's request_counts are sampled every second.

Modules, one job each: options (what a run does), workload (the batch file and the
interactive load), capacity (the spare capacity the fleet leaves for batch), probe (the
1 Hz samples), phase (one phase run), analysis (the numbers and goals), plot (the PNG),
report (results.json, summary.md), run (the stack and the phases), cli (the flags).
"""
