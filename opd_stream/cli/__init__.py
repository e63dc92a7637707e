"""The ``opd-stream`` command. Nothing here runs inside a host's process: the library
never imports this room.

Modules (all private; the public names come from :mod:`opd_stream`):

* ``_main``: the command line: ``demo``, ``score``, ``probe``, ``config``
* ``_demo``: ``opd-stream demo``: real rollouts scored against embedded mock servers
* ``_score``: ``opd-stream score``: a JSON Lines file of rollouts scored
* ``_score_options``: ``score``'s options
* ``_score_files``: ``score``'s input read in chunks, its output written
* ``_score_schema``: ``score``'s line schemas and codecs
* ``_probe``: ``opd-stream probe``
* ``_progress``: a small progress bar
* ``_parser_notice``: which answer parser runs, in words
"""

__all__: tuple[str, ...] = ()
