"""Process roles (rank 8): what one process of a run executes — worker (one loop over a
``SyncStrategy``), pipeline stage, coordinator (thin handlers over ``cluster``'s pure decisions),
parameter-server shard, and the links between them.  Started by ``flotilla.launch`` or the CLI.
"""
