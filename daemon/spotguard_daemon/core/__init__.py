"""The daemon itself: one per node, serving its clients and making their checkpoints durable.

* serving: ``app`` (:class:`~.app.Daemon`, the event loop that wires the rest), ``server`` (the
  request and publish sockets, the peer's credentials), ``handlers`` (one per request), ``peers``
  (who may register and be signalled), ``store`` (pending notices, persisted), ``delivery`` (the
  signal fallback), ``tasks`` (loops that are restarted when they die), ``abandon``, ``systemd``;
* ``watchers/``: the platform event sources (AWS, GCP, Azure, Alibaba, Slurm, signals, manual);
* durable uploads: ``uploads`` (the queue and its worker), ``upload_put`` (one checkpoint into the
  store), ``upload_retention`` (old checkpoints out of it), ``upload_journal``, ``confine``;
* ``goodput``, ``goodput_store``, ``metrics``: what a job achieved, and /metrics;
* ``settings``, ``_urls``, ``logs``, ``redact``: configuration and what may be printed.

Imports point down only: the core imports :mod:`spotguard` (the client library, for the protocol
and the stores) and the leaf :mod:`spotguard_daemon.proctree`, never
:mod:`spotguard_daemon.commands` (tests/test_imports.py).
"""
