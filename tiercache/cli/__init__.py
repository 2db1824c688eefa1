"""The ``tiercache`` command line: the top of the import order.

Owns: :mod:`.main` (the ``tiercache`` entry point and its sub-commands), :mod:`.config_cli`
(``tiercache config``), :mod:`.demo` (``tiercache demo``).
May import: anything in tiercache; nothing imports it.
"""
