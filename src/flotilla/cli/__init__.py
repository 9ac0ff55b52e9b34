"""Command line (rank 10, the top): ``flotilla run|coordinator|worker|server|profile|plan|validate``.

Each command parses its options and hands over to a launcher (``flotilla.launch``) or a role
(``flotilla.roles``); it holds no training, planning or protocol logic of its own.
"""
