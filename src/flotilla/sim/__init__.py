"""The simulator (SPEC §9; ``docs/simulator.md``): the runtime's pure decisions replayed in virtual
time on modelled clusters of any size.

Layer: beside ``roles`` (it imports the pure planning code of the layers below -- the loop
machine, the PS consistency gates, revocation traces, the communication cost model -- and never
torch, sockets, threads or the wall clock; ``tests/unit/test_architecture.py`` checks it).

- ``model``: the inputs (a compact cluster of device classes, the job, recovery costs) and the
  result;
- ``vote``: strategies whose members vote on every unit (``allreduce``, ``diloco``): the loop
  machine driven once for the agreed view, every member's compute and the collective modelled;
- ``ps``: the parameter server under BSP / SSP / ASP: one event per worker per clock, each pull
  answered when the consistency gate (``ps/consistency.may_serve_pull``) says so;
- ``partial_reduce``: the real group controller (``sync/pr_plan.GroupController``) forms the
  groups of ready workers, in virtual time;
- ``adpsgd``: the real peer choice and passive slots (``sync/adpsgd_plan.py``);
- ``pipeline``: the runtime's split (``pipeline/fixed_split.py``) and schedules
  (``pipeline/schedule.py``) replayed by ``pipeline/timeline.py``, PP x DP instances;
- ``trace``: a spot trace replayed onto groups of devices.

Each strategy's spec names its simulator (``StrategySpec.simulated``); ``flotilla simulate``
(``cli/simulate_cmd.py``) compares them.
"""
