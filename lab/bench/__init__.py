"""`globalpool bench`: routing policies side by side on one multi-region trace.

scenario.py (YAML) -> workload.py + capacity.py (a seeded trace, trace.py) -> testbed.py
(LocalStack, router replica per region) -> measure.py / replay.py / observe.py /
heartbeats.py (one policy's run) -> stats.py -> report.py, markdown.py, plot.py; twin.py
replays the same trace in virtual time without the machine. Entry point: run.py, cli.py.
"""
