"""hail-guard's benchmarks: what it adds to each send, how fast it drains, how it grows (issue 8).

Run from the repository root: `.venv/bin/python -m bench [--quick] [--json] [--only CASE]
[--ledger sqlite|postgres|both]`. Every case is measured beside its baseline in the same run:

- `overhead` (figures in `bench.overhead`): a guarded send and a pass-through read, through hail-guard
  vs straight to the sandbox, both in process over the SDK's in-memory streams;
- `drain` (`bench.drain`): a planned batch sent with bounded concurrency, vs the ideal and vs
  forwarding without the ledger;
- `growth` (`bench.growth`): the hot ledger operations on a small vs a large ledger, with query plans;
- `startup` (`bench.startup`): `hail-guard serve` spawned to its first tools/list answer;
- `memory` (`bench.memory`): peak RSS of `hail-guard batch plan` and `batch run` on a large batch.

Targets are printed, never asserted.
"""
