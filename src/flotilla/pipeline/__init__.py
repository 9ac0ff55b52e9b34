"""Pipeline model parallelism (rank 3; SPEC §3): pure planning (profile, plan, partition, schedule
IR, validation, timeline, stash plan) and the torch runtime (profiler, split, stash, stage
communication, instrumentation, stage runtime).  Devices and links come from
``flotilla.cluster.spec.ClusterSpec``.

The process role that runs a stage is ``flotilla.roles.stage``; the launcher ``flotilla.launch``.
"""
