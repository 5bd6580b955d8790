"""`python -m batchgen ...`: the same as the `batchgen` command."""

from batchgen.api.cli import main

raise SystemExit(main())
