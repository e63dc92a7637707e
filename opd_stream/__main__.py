"""``python -m opd_stream`` is the ``opd-stream`` command."""

from .cli._main import main

raise SystemExit(main())
