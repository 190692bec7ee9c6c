"""The ``spotguard`` commands: ``cli`` (the group; ``daemon``, ``status``, ``notify``,
``simulate``, ``version``) and the commands that drive a daemon and a job: ``run`` (with
``supervise`` and ``run_summary``), ``drill`` (with ``drill_checks``, ``drill_report``,
``drill_spread``, ``drill_tree``, ``drill_reaper``), ``demo``, ``checkpoints``, ``cadence``.
``common`` is what they share (the request helper, failures, settings).

A command talks to a daemon only through the client's protocol (:mod:`spotguard.protocol`), as any
client does; ``spotguard daemon`` starts :class:`spotguard_daemon.core.app.Daemon`. Commands may
import the core (its settings); the core never imports a command (tests/test_imports.py).
"""
