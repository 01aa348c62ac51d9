"""`python -m hail_guard` runs the command line."""

from hail_guard.cli import main

raise SystemExit(main())
