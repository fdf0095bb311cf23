"""The hostile drill (`globalpool drill hostile`): worker faults x client behaviours on real
processes on loopback, one cell per pair, each judged against the same goals.

- `http`: a raw HTTP/1.1 client with a small receive buffer;
- `clients`, `behaviours`: what a client sends, how it reads, what it waits for;
- `lane`: healthy simulated workers and a bad one (lab.sim's misbehave knob), their
  agents, a router restarted for every cell;
- `cell`: one fault x one behaviour, with witness requests beside it;
- `measure`: lost, healthy_ejected, detect_s, router_5xx, RSS;
- `run`, `report`, `plot`, `cli`: the matrix, report.json / report.md / matrix.png.
"""
