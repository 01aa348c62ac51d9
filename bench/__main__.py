"""`python -m bench` runs the benchmark suite (see `bench.cli`)."""

from bench.cli import main

raise SystemExit(main())
