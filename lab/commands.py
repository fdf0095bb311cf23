"""The lab's subcommands of `globalpool`, by name: how each adds its flags and what runs it
(`router.lab_commands` reads this table only where the lab is installed)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from lab.batchbench import cli as batchbench
from lab.bench.cli import add_bench_arguments, run_bench_command
from lab.benchproxy import cli as benchproxy
from lab.benchproxy import memory, slow_readers
from lab.drill.cli import add_drill_arguments, run_drill_command
from lab.sim.cli import add_sim_arguments, run_sim

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]

SUBCOMMANDS: dict[str, tuple[AddArguments, Run]] = {
    "sim": (add_sim_arguments, run_sim),
    "bench-proxy": (benchproxy.add_bench_proxy_arguments, benchproxy.run_bench_proxy),
    "bench-decision": (benchproxy.add_bench_decision_arguments, benchproxy.run_bench_decision),
    "bench-heartbeats": (benchproxy.add_bench_heartbeats_arguments,
                         benchproxy.run_bench_heartbeats),
    "bench-instructions": (benchproxy.add_bench_instructions_arguments,
                           benchproxy.run_bench_instructions),
    "bench-slow-readers": (slow_readers.add_arguments, slow_readers.run_command),
    "bench-memory": (memory.add_arguments, memory.run_command),
    "bench": (add_bench_arguments, run_bench_command),
    "bench-batch": (batchbench.add_arguments, batchbench.run_command),
    "drill": (add_drill_arguments, run_drill_command),
}
