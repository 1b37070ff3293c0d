"""One module per ``sdcguard`` command: its arguments (``configure``), its output and ``--json`` (``run``).

Each adapter calls the plain functions of the part it drives and turns that
part's own errors into :class:`sdcguard.errors.CommandError`.
"""
