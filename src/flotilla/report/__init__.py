"""Run reports (rank 4): metrics records (``metrics``), the run summary (``summary``), plots,
pipeline Gantt charts (``gantt``) and the PS clock spread (``clock_spread``, pure).

Imports only ``core`` and the pure pipeline modules: never ``trainer``, ``roles`` or ``launch``.
"""
