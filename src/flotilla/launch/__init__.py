"""Launchers (rank 9): the embedded local cluster (``local``), the pipeline job (``pipeline``), the
live progress display, and one ``Supervisor`` that starts, watches and stops every child process.
"""
