"""Trainer (rank 7): build a job from its configuration (data, model, optimizer, task, pipeline
setup), the training step, and the single-process reference used as the tests' oracle.

No process role lives here (those are ``flotilla.roles``); nothing here starts a process.
"""
