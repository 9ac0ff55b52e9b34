"""Data-parallel synchronisation (rank 4): the ``SyncStrategy`` contract (``base``), its pure
decisions (``plan``), the strategies (``allreduce``, ``via_ps``), their registry and state transfer.
"""
