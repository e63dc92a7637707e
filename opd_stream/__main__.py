"""``python -m opd_stream`` is the ``opd-stream`` command."""

from ._cli import main

raise SystemExit(main())
